"""Reward functions (slime's rm hub): `async (args, sample) -> float | dict`.

`rm_type` picks a built-in from `REWARD_FUNCTIONS`; `custom_rm_path` names a user function by
import string instead. A sample may override the type with `metadata["rm_type"]`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from engines.hooks import load_hook
from storage.sample import Sample

RewardFn = Callable[[Any, Sample], Awaitable[float | dict[str, float]]]

_FINAL_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def normalize_answer(text: str) -> str:
    return " ".join(text.strip().split()).lower()


def exact_match_score(response: str, label: str | None) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the label."""
    if label is None:
        return 0.0
    return 1.0 if normalize_answer(response) == normalize_answer(label) else 0.0


def last_number_score(response: str, label: str | None) -> float:
    """1.0 when the last number in the response equals the label's number."""
    if label is None:
        return 0.0
    found = _FINAL_NUMBER.findall(response)
    return 1.0 if found and found[-1] == label.strip() else 0.0


async def exact_match(args: Any, sample: Sample) -> float:
    return exact_match_score(sample.response, sample.label)


async def last_number(args: Any, sample: Sample) -> float:
    return last_number_score(sample.response, sample.label)


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "last_number": last_number,
}


def resolve_reward_fn(rm_type: str | None, custom_rm_path: str | None) -> RewardFn | None:
    """The run's default reward function (None when neither key is set)."""
    if custom_rm_path:
        return load_hook(custom_rm_path, "rollout.custom_rm_path", 2, must_be_async=True)
    if rm_type is None:
        return None
    if rm_type not in REWARD_FUNCTIONS:
        raise ValueError(
            f"rollout.rm_type: unknown reward {rm_type!r}; built-ins: {sorted(REWARD_FUNCTIONS)}"
        )
    return REWARD_FUNCTIONS[rm_type]


async def compute_reward(args: Any, sample: Sample, default: RewardFn | None) -> float | dict:
    override = sample.metadata.get("rm_type")
    fn = REWARD_FUNCTIONS.get(override) if override else default
    if fn is None:
        raise ValueError(
            f"sample {sample.index}: no reward function (set rollout.rm_type or "
            f"rollout.custom_rm_path, or metadata.rm_type to one of {sorted(REWARD_FUNCTIONS)})"
        )
    return await fn(args, sample)
