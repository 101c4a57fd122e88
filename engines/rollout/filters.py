"""Group filters (slime's filter hub): which finished groups a step keeps.

* dynamic-sampling filter `(args, group) -> bool`: asked for every finished group during
  generation; a rejected group is dropped and more prompts are drawn (DAPO dynamic sampling).
* over-sampling filter `(args, groups) -> groups`: given the over-sampled kept groups, returns
  them in preference order; the filter stage keeps the first `rollout_batch_size`.

A config key names a built-in from the registries below or a user function by import string;
either is checked at startup, so a typo fails before the first step.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from engines.hooks.loader import check_protocol, load_user_hook
from engines.hooks.protocols import DynamicFilterFn, OverSamplingFilterFn
from storage.sample import Group

DynamicFilter = Callable[[Any, Group], bool]
OverSamplingFilter = Callable[[Any, list[Group]], list[Group]]


def group_rewards(group: Group, reward_key: str | None = None) -> list[float]:
    return [s.scalar_reward(reward_key) for s in group]


def reward_std(group: Group, reward_key: str | None = None) -> float:
    rewards = group_rewards(group, reward_key)
    return statistics.pstdev(rewards) if len(rewards) > 1 else 0.0


def _reward_key(args: Any) -> str | None:
    rollout = getattr(args, "rollout", args)
    return getattr(rollout, "reward_key", None)


def check_reward_nonzero_std(args: Any, group: Group) -> bool:
    """Keep a group only if its rewards differ: with GRPO an all-equal group has zero
    advantage everywhere and trains nothing."""
    return reward_std(group, _reward_key(args)) > 0.0


def sort_by_reward_std(args: Any, groups: list[Group]) -> list[Group]:
    """Most informative groups first (highest reward std); ties keep their order."""
    key = _reward_key(args)
    return sorted(groups, key=lambda g: -reward_std(g, key))


DYNAMIC_FILTERS: dict[str, DynamicFilter] = {
    "check_reward_nonzero_std": check_reward_nonzero_std,
}
OVER_SAMPLING_FILTERS: dict[str, OverSamplingFilter] = {
    "sort_by_reward_std": sort_by_reward_std,
}


def _resolve(path: str | None, key: str, registry: dict[str, Any], protocol: type) -> Any:
    if path is None:
        return None
    if path in registry:
        check_protocol(registry[path], protocol, key)
        return registry[path]
    if "." not in path and ":" not in path:
        raise ValueError(f"{key}: {path!r} is neither an import string like 'pkg.mod:fn' nor "
                         f"a built-in (built-ins: {sorted(registry)})")
    return load_user_hook(path, key, protocol)


def resolve_dynamic_filter(path: str | None) -> DynamicFilter | None:
    """A built-in name or an import string, checked against DynamicFilterFn at startup."""
    fn: DynamicFilter | None = _resolve(
        path, "rollout.dynamic_sampling_filter_path", DYNAMIC_FILTERS, DynamicFilterFn
    )
    return fn


def resolve_over_sampling_filter(path: str | None) -> OverSamplingFilter | None:
    """A built-in name or an import string, checked against OverSamplingFilterFn."""
    fn: OverSamplingFilter | None = _resolve(
        path, "rollout.over_sampling_filter_path", OVER_SAMPLING_FILTERS, OverSamplingFilterFn
    )
    return fn
