"""SFT as a rollout function, the way slime does SFT: no generation, the data is the response.

Plugged in with `rollout.function_path: engines.rollout.sft_rollout:sft_rollout` and
`algorithm.loss_type: sft_loss`; the rest of the step (storage, train, commit) is unchanged,
so an SFT warm start is just a few ordinary rollflow steps. Two kinds of rows:

* prompt + label: the response is `label` + EOS, every response token trained.
* a conversation (chat messages in `data.input_key`, no label): rendered with the chat
  template (`engines.rollout.loss_mask`); the response starts at the first assistant token
  and only assistant turns are trained (user/tool turns in between get loss mask 0).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from engines.chat.tokenizer import encode_texts, load_tokenizer
from engines.data.prompt_dataset import DatasetSpec, data_spec
from engines.data.prompt_files import open_rows
from engines.rollout.loss_mask import chat_loss_mask
from storage.sample import Group, Sample, Status


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    return load_tokenizer(path)


@lru_cache(maxsize=2)
def _conversations(spec: DatasetSpec) -> dict[tuple[str | None, int], list[dict[str, Any]]]:
    """Raw chat rows by (file, line), the file None for a one-file set (as the samples'
    `source_file` metadata has it): the prompt loader keeps chat prompts only as rendered
    text (with a generation prompt), which cannot be split back into turns."""
    rows = open_rows(spec)
    many = len(rows.shards) > 1
    return {(file if many else None, line): row[spec.input_key]
            for batch in rows.batches() for file, line, row in batch
            if isinstance(row.get(spec.input_key), list)}


def _messages(args: Any, s: Sample) -> list[dict[str, Any]] | None:
    if isinstance(s.prompt, list):
        return s.prompt
    line = s.metadata.get("source_line")
    if line is None:
        return None
    spec = data_spec(args.data, args.storage, None)
    return _conversations(spec).get((s.metadata.get("source_file"), int(line)))


def _finish(s: Sample, tokens: list[int], response_length: int, loss_mask: list[int], text: str) -> None:
    s.tokens = tokens
    s.response = text
    s.response_length = response_length
    s.loss_mask = loss_mask
    s.rollout_log_probs = []
    s.reward = 0.0
    s.status = Status.COMPLETED
    s.check()


def sft_prompt_label(tokenizer: Any, s: Sample, label_ids: list[int]) -> None:
    """Response = label + EOS after the (already tokenised) prompt; `label_ids`: the label's
    ids (the caller tokenises a draw's labels at once, `encode_texts`)."""
    assert s.label is not None
    response_ids = [*label_ids, tokenizer.eos_token_id]
    _finish(s, list(s.tokens) + response_ids, len(response_ids), [1] * len(response_ids), s.label)


def sft_conversation(tokenizer: Any, s: Sample, messages: list[dict[str, Any]]) -> None:
    """Whole conversation; the prompt is everything before the first assistant token."""
    conv = chat_loss_mask(tokenizer, messages)
    start = conv.response_start
    if start == len(conv.token_ids):
        raise ValueError(
            f"SFT sample {s.index} (line {s.metadata.get('source_line')}): the conversation "
            "has no assistant turn to train on"
        )
    response = conv.token_ids[start:]
    _finish(s, conv.token_ids, len(response), conv.loss_mask[start:], tokenizer.decode(response))


def sft_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> list[Group]:
    """`rollout_batch_size` groups of SFT samples (a `RolloutFn`)."""
    tokenizer = _tokenizer(args.train.model_path or args.train.load)
    groups = data_source.get_samples(args.rollout.rollout_batch_size)
    labelled = [s for group in groups for s in group if s.label is not None]
    label_ids = encode_texts(tokenizer, [str(s.label) for s in labelled])
    for s, ids in zip(labelled, label_ids, strict=True):
        sft_prompt_label(tokenizer, s, ids)
    for group in groups:
        for s in group:
            if s.label is not None:
                continue
            messages = _messages(args, s)
            if messages is None:
                raise ValueError(
                    f"SFT sample {s.index} (line {s.metadata.get('source_line')}) has neither "
                    "a label nor a chat conversation"
                )
            sft_conversation(tokenizer, s, messages)
    return groups
