"""The compatibility reward API resolves through the same registry (boxed_math grades in the
grading pool's processes)."""

from __future__ import annotations

import asyncio

from engines.rollout.rewards.rm_hub import compute_reward, resolve_reward_fn
from storage.sample import Sample


def answer(response: str, label: str, **meta: str) -> Sample:
    return Sample(index=0, group_index=0, prompt="q", response=response, label=label,
                  metadata=meta)


def test_compat_api_resolves_through_the_same_registry() -> None:
    fn = resolve_reward_fn("boxed_math", None)
    assert fn is not None
    assert asyncio.run(compute_reward(None, answer(r"\boxed{0.25}", r"\frac14"), fn)) == 1.0
    last_number = answer("7", "7", rm_type="last_number")
    assert asyncio.run(compute_reward(None, last_number, None)) == 1.0
