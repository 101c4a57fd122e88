"""Chat-template loss masks and the SFT rollout (conversation and prompt+label rows)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from engines.data.prompt_dataset import DatasetSpec, load_prompt_samples
from engines.rollout.loss_mask import LossMaskError, chat_loss_mask
from engines.rollout.sft_rollout import sft_rollout
from flows.config.run import RollflowConfig
from storage.sample import Group, Status

CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "yes 3"},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def trained_text(tokenizer: Any, ids: list[int], mask: list[int]) -> list[str]:
    """The maximal runs of trained tokens, decoded."""
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(tokenizer.decode(cur))
            cur = []
    return runs + ([tokenizer.decode(cur)] if cur else [])


def test_only_assistant_turns_and_their_end_of_turn_are_trained(tokenizer: Any) -> None:
    conv = chat_loss_mask(tokenizer, CONVERSATION)
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert conv.token_ids == tokenizer.encode(full, add_special_tokens=False)
    assert len(conv.loss_mask) == len(conv.token_ids)
    # template: "{role}: {content}\n" per message
    assert trained_text(tokenizer, conv.token_ids, conv.loss_mask) == ["3\n", "yes 3\n"]
    assert conv.response_start == len("system: be brief\nuser: 1+2=\nassistant: ")
    tools_trained = chat_loss_mask(tokenizer, CONVERSATION, train_roles=("assistant", "tool"))
    assert trained_text(tokenizer, tools_trained.token_ids, tools_trained.loss_mask) == [
        "3\ntool: ok\n", "yes 3\n"  # a non-assistant role is trained with its header
    ]


def test_a_template_that_rewrites_earlier_turns_is_rejected(tiny_model_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # renders only the *last* assistant message: prefixes are not prefixes of the whole
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(LossMaskError, match="message 2: the chat template"):
        chat_loss_mask(tok, CONVERSATION)


class ListSource:
    def __init__(self, groups: list[Group]):
        self.groups = groups

    def get_samples(self, n: int) -> list[Group]:
        taken, self.groups = self.groups[:n], self.groups[n:]
        return taken


def test_sft_rollout_handles_conversations_and_prompt_label_rows(
    tmp_path: Path, tiny_model_dir: str, tokenizer: Any
) -> None:
    path = tmp_path / "sft.jsonl"
    rows = [
        {"messages": CONVERSATION},
        {"messages": [{"role": "user", "content": "2+2="}], "label": "4"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    args = RollflowConfig.model_validate(
        {
            "data": {"prompt_data": str(path), "input_key": "messages", "apply_chat_template": True},
            "rollout": {"num_rollout": 1, "rollout_batch_size": 2},
            "algorithm": {"loss_type": "sft_loss"},
            "engine": {"backend": "mock"},
            "train": {"backend": "torch", "model_path": tiny_model_dir},
        }
    )
    spec = DatasetSpec(path=str(path), input_key="messages", apply_chat_template=True)
    samples = load_prompt_samples(spec, tokenizer).samples
    for i, s in enumerate(samples):
        s.index = s.group_index = i
    chat, labelled = (g[0] for g in sft_rollout(args, 0, ListSource([[s] for s in samples])))

    expected = chat_loss_mask(tokenizer, CONVERSATION)
    assert chat.tokens == expected.token_ids and chat.status == Status.COMPLETED
    assert chat.prompt_length == expected.response_start
    assert chat.loss_mask == expected.loss_mask[expected.response_start :]
    assert tokenizer.decode(chat.response_tokens) == "3\ntool: ok\nassistant: yes 3\n"
    assert chat.response == "3\ntool: ok\nassistant: yes 3\n"
    assert sum(chat.loss_mask) == len("3\n") + len("yes 3\n")

    assert tokenizer.decode(labelled.prompt_tokens) == "user: 2+2=\nassistant: "
    assert labelled.response_tokens == tokenizer.encode("4", add_special_tokens=False) + [
        tokenizer.eos_token_id
    ]
    assert labelled.loss_mask == [1, 1] and labelled.reward == 0.0
