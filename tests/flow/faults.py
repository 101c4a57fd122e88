"""Fault-injection hooks for the flow tests, plugged in through the normal extension points."""

from __future__ import annotations

import os
from typing import Any

from engines.rollout.rewards.rm_hub import exact_match


async def reward_failing_once(args: Any, sample: Any) -> float:
    """exact_match, but the first call for sample index FAIL_INDEX raises (once per run)."""
    marker = os.path.join(args.storage.uri, args.storage.run_name, "fault-fired")
    if sample.index == int(os.environ.get("ROLLFLOW_FAIL_INDEX", "20")) and not os.path.exists(marker):
        open(marker, "w").close()
        raise ConnectionError("injected transient fault")
    return await exact_match(args, sample)


async def reward_exact(args: Any, sample: Any) -> float:
    """exact_match as a custom hook: the fixed version of `reward_nan_after_step_0`."""
    return await exact_match(args, sample)


async def reward_nan_after_step_0(args: Any, sample: Any) -> float:
    """A broken hook: NaN for every fifth sample after the first step's (the issue's case)."""
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
