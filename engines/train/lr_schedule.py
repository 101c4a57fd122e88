"""Learning-rate schedule: linear warmup, then constant, cosine or linear decay to `min_lr`.

`lr_at(step)` is the rate used by optimizer step `step` (0-based). Warmup reaches the peak
at step `warmup - 1` ((step + 1) / warmup, so the first step never runs at lr 0); decay then
runs over steps [warmup, decay_steps) and holds `min_lr` afterwards, as Megatron's
`lr_decay_iters` does. The scheduler is a `LambdaLR`, so its state (the step count) is saved
and restored with the checkpoint; `retarget` then points it at the settings in force.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engines.config.train import TrainConfig


def lr_at(
    step: int,
    base_lr: float,
    warmup_steps: int = 0,
    decay_style: str = "constant",
    decay_steps: int | None = None,
    min_lr: float = 0.0,
) -> float:
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if decay_style == "constant":
        return base_lr
    if decay_steps is None:
        raise ValueError(f"lr_decay_style={decay_style!r} needs lr_decay_steps")
    span = max(decay_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    if decay_style == "cosine":
        return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay_style == "linear":
        return base_lr - (base_lr - min_lr) * progress
    raise ValueError(f"unknown lr_decay_style {decay_style!r}; one of constant, cosine, linear")


def scheduled_lr(cfg: TrainConfig, base_lr: float, step: int) -> float:
    """The rate of optimizer step `step` of a part (actor, critic) that peaks at `base_lr`;
    `min_lr` scales with it. Megatron sets it on its param groups before each step."""
    min_lr = cfg.min_lr * base_lr / cfg.lr
    return lr_at(step, base_lr, cfg.lr_warmup_steps, cfg.lr_decay_style, cfg.lr_decay_steps, min_lr)


def _factor(cfg: TrainConfig, base_lr: float) -> Callable[[int], float]:
    def factor(step: int) -> float:
        return scheduled_lr(cfg, base_lr, step) / base_lr

    return factor


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig, base_lr: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR whose factor is `scheduled_lr(step) / base_lr`."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _factor(cfg, base_lr))


def retarget(scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: TrainConfig, base_lr: float) -> None:
    """Make `scheduler` follow `cfg`'s schedule peaking at `base_lr` from the step it is at,
    and set its optimizer's rate for that step. A restored scheduler state brings back the
    base rate it was saved with; this makes a changed `train.lr` (or schedule) count, as
    it does on a fresh trainer, and lets a replay switch to the settings a step had."""
    groups = scheduler.optimizer.param_groups
    factor = _factor(cfg, base_lr)
    scheduler.base_lrs = [base_lr] * len(groups)
    scheduler.lr_lambdas = [factor] * len(groups)
    for group in groups:
        group["initial_lr"] = base_lr
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]  # what get_last_lr() reports
