"""Filters named by import string in the flow tests (real hooks, loaded like a user's)."""

from __future__ import annotations

from typing import Any

from storage.sample import Group, Sample


def drop_odd_groups(args: Any, group: Group) -> bool:
    """Deterministic dynamic filter: the mock engine's rewards are all 0, so reward std
    cannot drive the test; group parity can."""
    return group[0].group_index % 2 == 0


def train_on_first_of_group(args: Any, sample: Sample) -> bool:
    """Sample filter: only each group's first sample reaches the loss."""
    return sample.index % args.rollout.n_samples_per_prompt == 0
