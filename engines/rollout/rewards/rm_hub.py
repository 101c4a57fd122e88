"""Reward functions (slime's rm hub): `async (args, sample) -> float | dict`.

The implementation lives in `engines.rollout.rewards`; this module is the stable import path used by
the generation loop. Prefer `RewardHub.from_config(rollout_cfg)`, which also knows
`group_rm`, `remote_rm` and the `boxed_` prefix; `resolve_reward_fn` / `compute_reward` are
the per-sample view of the same registry.
"""

from __future__ import annotations

from typing import Any

from engines.hooks.loader import load_user_hook
from engines.hooks.protocols import GroupRewardFn, Reward, RewardFn
from engines.rollout.rewards import (
    REWARD_FUNCTIONS,
    RewardConfigError,
    RewardHub,
    builtin_reward,
    exact_match_score,
    last_number_score,
)
from engines.rollout.rewards.deadline import DEFAULT_TIMEOUT_S
from engines.rollout.rewards.text_rules import normalize_answer
from storage.sample import Sample

__all__ = [
    "REWARD_FUNCTIONS",
    "GroupRewardFn",
    "Reward",
    "RewardConfigError",
    "RewardFn",
    "RewardHub",
    "compute_reward",
    "exact_match",
    "exact_match_score",
    "last_number",
    "last_number_score",
    "normalize_answer",
    "resolve_reward_fn",
]


# The built-ins as plain functions, for hooks that wrap one (e.g. tests/support/hooks.py).
exact_match: RewardFn = REWARD_FUNCTIONS["exact_match"]
last_number: RewardFn = REWARD_FUNCTIONS["last_number"]


def resolve_reward_fn(
    rm_type: str | None, custom_rm_path: str | None, rule_timeout_s: float = DEFAULT_TIMEOUT_S
) -> RewardFn | None:
    """The run's default per-sample reward function (None when neither key is set);
    `rule_timeout_s` is the grading deadline of rule rewards (`rollout.rm_rule_timeout_s`)."""
    if custom_rm_path:
        fn: RewardFn = load_user_hook(custom_rm_path, "rollout.custom_rm_path", RewardFn)
        return fn
    if rm_type is None:
        return None
    return builtin_reward(rm_type, "rollout.rm_type", rule_timeout_s=rule_timeout_s)


async def compute_reward(args: Any, sample: Sample, default: RewardFn | None) -> Reward:
    """Score one sample: its `metadata.rm_type` if set, else `default`."""
    return await RewardHub(default).score(args, sample)
