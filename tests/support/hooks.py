"""Hooks the tests plug in by import string (`tests.support.hooks:NAME`), loaded in the actors
like a user's: fault injection, a filter pair and an eval function that reports the engines'
weight versions."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx

from engines.rollout.rewards.rm_hub import exact_match
from storage.sample import Group, Sample


def _fail_once(args: Any, sample: Any) -> None:
    """Raise on the first call for sample index FAIL_INDEX of the run (a marker file in the
    run directory says it fired)."""
    marker = os.path.join(args.storage.uri, args.storage.run_name, "fault-fired")
    if sample.index == int(os.environ.get("ROLLFLOW_FAIL_INDEX", "20")) and not os.path.exists(marker):
        open(marker, "w").close()
        raise ConnectionError("injected transient fault")


async def reward_failing_once(args: Any, sample: Any) -> float:
    """exact_match, but the first call for sample index FAIL_INDEX raises (once per run)."""
    _fail_once(args, sample)
    return await exact_match(args, sample)


def response_score(sample: Any) -> float:
    """A reward that differs from sample to sample (the share of distinct tokens in the
    response), where exact_match on an untrained model is 0 for every one: two runs whose
    rewards got mixed up, or were scored for other responses, then differ."""
    tokens = sample.tokens[len(sample.tokens) - sample.response_length:]
    return len(set(tokens)) / max(len(tokens), 1)


async def reward_varied(args: Any, sample: Any) -> float:
    """`response_score` as a reward hook (the reference of `reward_varied_failing_once`)."""
    return response_score(sample)


async def reward_varied_failing_once(args: Any, sample: Any) -> float:
    """`reward_varied`, but the first call for sample index FAIL_INDEX raises (once per run)."""
    _fail_once(args, sample)
    return response_score(sample)


async def reward_exact(args: Any, sample: Any) -> float:
    """exact_match as a custom hook: the fixed version of `reward_nan_after_step_0`."""
    return await exact_match(args, sample)


RELEASE_FILE = "release-step-1"
"""The file in the run directory that lets `reward_held_in_step_1` score step 1."""


async def reward_held_in_step_1(args: Any, sample: Any) -> float:
    """exact_match, but step 1's samples wait until RELEASE_FILE exists in the run directory
    (at most 300 s): a test that acts on a run mid-step then finds it there however slow the
    machine, rather than racing a run that may have finished."""
    per_step = args.rollout.rollout_batch_size * args.rollout.n_samples_per_prompt
    if per_step <= sample.index < 2 * per_step:
        release = os.path.join(args.storage.uri, args.storage.run_name, RELEASE_FILE)
        for _ in range(1500):
            if os.path.exists(release):
                break
            await asyncio.sleep(0.2)
    return await exact_match(args, sample)


async def reward_nan_after_step_0(args: Any, sample: Any) -> float:
    """A broken hook: NaN for every fifth sample after the first step's."""
    per_step = args.rollout.rollout_batch_size * args.rollout.n_samples_per_prompt
    if sample.index >= per_step and sample.index % 5 == 0:
        return float("nan")
    return await exact_match(args, sample)


def nan_grad_loss_once(algo: Any, inputs: Any, denominator: float) -> tuple[Any, dict[str, Any]]:
    """The policy loss, whose gradient is NaN on the first call in this process (d sqrt(x-x)
    = inf * 0): one optimizer step must be skipped and the run go on."""
    import torch

    from engines.algorithms.losses import actor_loss

    loss, metrics = actor_loss(algo, inputs, denominator)
    if not getattr(nan_grad_loss_once, "fired", False):
        nan_grad_loss_once.fired = True  # type: ignore[attr-defined]
        loss = loss + torch.sqrt(loss - loss)
    return loss, metrics


SLOW_LOSS_S = 0.4
"""How much later `slow_policy_loss` answers than the policy loss."""


def slow_policy_loss(algo: Any, inputs: Any, denominator: float) -> tuple[Any, dict[str, Any]]:
    """The policy loss, SLOW_LOSS_S later each call (each micro-batch): a train step that
    lasts seconds on a wall clock without the CPU that dozens of epochs of training burned
    for it (tests/flow/test_async.py)."""
    from engines.algorithms.losses import actor_loss

    time.sleep(SLOW_LOSS_S)
    return actor_loss(algo, inputs, denominator)


async def engine_versions(args: Any, weight_version: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        versions = [(await client.get(f"{url}/weight_version")).json()["weight_version"]
                    for url in args.engine_urls]
    return {"engines_min_version": min(versions), "engines_max_version": max(versions),
            "asked_version": weight_version}


def drop_odd_groups(args: Any, group: Group) -> bool:
    """Deterministic dynamic filter: the mock engine's rewards are all 0, so reward std
    cannot drive the test; group parity can."""
    return group[0].group_index % 2 == 0


def train_on_first_of_group(args: Any, sample: Sample) -> bool:
    """Sample filter: only each group's first sample reaches the loss."""
    return sample.index % args.rollout.n_samples_per_prompt == 0


# the slow reward of the group-journal flow test (tests/flow/test_group_journal_kill.py)
GROUPS_PER_STEP = 16
MOMENT_S = 0.15


async def slow_exact_match(args: Any, sample: Any) -> float:
    """exact_match, scored MOMENT_S x (group index) after the response comes back, so a step's
    groups finish one after another and a kill lands with some committed and some not; every
    scored sample's index goes to `scored.txt` in the run directory, which tells the test which
    groups a rerun generated again."""
    await asyncio.sleep(MOMENT_S * (sample.group_index % GROUPS_PER_STEP))
    with open(os.path.join(args.storage.uri, args.storage.run_name, "scored.txt"), "a") as f:
        f.write(f"{sample.index}\n")
    return await exact_match(args, sample)
