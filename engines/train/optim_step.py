"""One optimizer step over a global batch split into micro-batches, shared by actor and
critic: zero grads, accumulate scaled micro-batch losses, clip, step, advance the LR --
unless the loss or the gradient norm is not finite (see `finite.py`)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.train.distributed import DataParallel
from engines.train.finite import NonFiniteError

MicroBatchLoss = Callable[[list[int]], tuple[Tensor, dict[str, Tensor]]]
SKIPPED_STEPS = "skipped_steps"
_TRAINED_LOSS = "__trained_loss__"  # summed over ranks with the metrics, then dropped


@dataclass(slots=True)
class Optimized:
    """A trainable module with its optimizer and LR scheduler. `module` is what runs the
    forward (DDP-wrapped when data parallel); `params` what is clipped."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    clip_grad: float
    max_consecutive_skips: int = 5
    consecutive_skips: int = 0  # a run of skips this long means training cannot recover


def optimizer_step(
    opt: Optimized,
    micro_batches: list[list[int]],
    loss_fn: MicroBatchLoss,
    dp: DataParallel,
    device: torch.device,
    prefix: str = "",
) -> dict[str, float]:
    """Accumulate `loss_fn` over `micro_batches` (this rank's), clip, step.

    A rank without samples still runs one zero-weighted micro-batch (`[]` is passed and the
    caller maps it to some sample), so DDP's collective gradient all-reduce never hangs.

    A non-finite gradient norm skips the step (weights, optimizer state and LR schedule
    untouched; `skipped_steps` is 1); a non-finite loss also raises `NonFiniteError`. Both
    tests use values every rank shares (the all-reduced gradient, the summed loss), so all
    data-parallel ranks decide alike.
    """
    opt.optimizer.zero_grad(set_to_none=True)
    totals: dict[str, float] = defaultdict(float)
    batches = micro_batches or [[]]
    for k, mb in enumerate(batches):
        with dp.no_sync(opt.module, skip=k < len(batches) - 1):
            loss, terms = loss_fn(mb)
            weight = float(dp.world_size) if mb else 0.0
            (loss * weight).backward()
        if mb:
            totals[_TRAINED_LOSS] += float(loss.detach())
            for key, value in terms.items():
                totals[prefix + key] += float(value)
    params = [p for p in opt.module.parameters() if p.requires_grad]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, opt.clip_grad))
    lr = opt.optimizer.param_groups[0]["lr"]
    out = dp.sum_metrics(dict(totals), device)
    loss_value = out.pop(_TRAINED_LOSS, 0.0)
    skip = not (math.isfinite(grad_norm) and math.isfinite(loss_value))
    opt.consecutive_skips = opt.consecutive_skips + 1 if skip else 0
    if skip:
        opt.optimizer.zero_grad(set_to_none=True)
        if opt.consecutive_skips >= opt.max_consecutive_skips:
            raise NonFiniteError(
                f"{prefix or 'actor '}gradient norm was not finite for {opt.consecutive_skips} "
                "optimizer steps in a row (train.max_consecutive_skipped_steps); the weights "
                "are those before the first of them"
            )
    else:
        opt.optimizer.step()
        opt.scheduler.step()
        out[prefix + "grad_norm"] = grad_norm  # absent when skipped: step means leave it out
    if not math.isfinite(loss_value):
        raise NonFiniteError(
            f"{prefix or 'actor '}loss is {loss_value} (grad norm {grad_norm}); the optimizer "
            f"step was not taken. Look for NaN/inf advantages, log-probs or a custom loss"
        )
    out[prefix + SKIPPED_STEPS] = float(skip)
    out[prefix + "lr"] = float(lr)
    return out
