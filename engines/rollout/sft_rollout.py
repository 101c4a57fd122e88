"""SFT as a rollout function, the way slime does SFT: no generation, the label is the response.

Plugged in with `rollout.function_path: engines.rollout.sft_rollout:sft_rollout` and
`algorithm.loss_type: sft_loss`; the rest of the step (storage, train, commit) is unchanged,
so an SFT warm start is just a few ordinary rollflow steps.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from storage.sample import Group, Status


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def sft_rollout(
    args: Any, rollout_id: int, data_source: Any, evaluation: bool = False
) -> list[Group]:
    """Groups whose response is `label` + EOS, every response token trained (loss mask 1)."""
    tokenizer = _tokenizer(args.train.model_path or args.train.load)
    groups = data_source.get_samples(args.rollout.rollout_batch_size)
    for group in groups:
        for s in group:
            if s.label is None:
                raise ValueError(
                    f"SFT sample {s.index} (line {s.metadata.get('source_line')}) has no label"
                )
            response_ids = tokenizer.encode(s.label, add_special_tokens=False)
            response_ids.append(tokenizer.eos_token_id)
            s.tokens = list(s.tokens) + response_ids
            s.response = s.label
            s.response_length = len(response_ids)
            s.loss_mask = [1] * len(response_ids)
            s.rollout_log_probs = []
            s.reward = 0.0
            s.status = Status.COMPLETED
    return groups
