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
from engines.train.step_model import MicroBatch

MicroBatchLoss = Callable[[list[int]], tuple[Tensor, dict[str, Tensor]]]
SKIPPED_STEPS = "skipped_steps"
TRAINED_LOSS = "__trained_loss__"  # summed over ranks with the metrics, then dropped


@dataclass(slots=True)
class OptimizedModel:
    """A trainable module with its optimizer and LR scheduler. `module` is what runs the
    forward (DDP-wrapped when data parallel); `params` what is clipped."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    clip_grad: float
    max_consecutive_skips: int = 5
    consecutive_skips: int = 0  # a run of skips this long means training cannot recover


def optimizer_step(
    opt: OptimizedModel,
    micro_batches: list[MicroBatch],
    loss_fn: MicroBatchLoss,
    dp: DataParallel,
    device: torch.device,
    prefix: str = "",
) -> dict[str, float]:
    """Accumulate `loss_fn(rows)` over `micro_batches` (this rank's), clip, step.

    An uncounted micro-batch (a rank without samples) runs with weight 0, so DDP's
    collective gradient all-reduce never hangs.

    A non-finite gradient norm skips the step (weights, optimizer state and LR schedule
    untouched; `skipped_steps` is 1); a non-finite loss also raises `NonFiniteError`. Both
    tests use values every rank shares (the all-reduced gradient, the summed loss), so all
    data-parallel ranks decide alike.
    """
    opt.optimizer.zero_grad(set_to_none=True)
    sums = _Sums()
    for k, mb in enumerate(micro_batches):
        with dp.no_sync(opt.module, skip=k < len(micro_batches) - 1):
            loss, terms = loss_fn(mb.rows)
            weight = float(dp.world_size) if mb.counted else 0.0
            (loss * weight).backward()
        # every rank records the same keys (an uncounted stand-in adds 0): sum_metrics is a
        # collective, and a rank left with only a stand-in must join it too
        counted = mb.counted and dp.counts_metrics
        sums.add(TRAINED_LOSS, loss, counted)
        for key, value in terms.items():
            sums.add(prefix + key, value, counted)
    totals = sums.floats()
    params = [p for p in opt.module.parameters() if p.requires_grad]
    total = torch.nn.utils.clip_grad_norm_(params, opt.clip_grad)
    # FSDP2's is a DTensor, already reduced over the shards: `full_tensor` reads it whole
    grad_norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
    lr = opt.optimizer.param_groups[0]["lr"]
    out = dp.sum_metrics(dict(totals), device)
    loss_value = out.pop(TRAINED_LOSS, 0.0)
    skip = not (math.isfinite(grad_norm) and math.isfinite(loss_value))
    if skip:
        opt.optimizer.zero_grad(set_to_none=True)
    opt.consecutive_skips = count_skip(
        opt.consecutive_skips, skip, opt.max_consecutive_skips, prefix
    )
    if not skip:
        opt.optimizer.step()
        opt.scheduler.step()
        out[prefix + "grad_norm"] = grad_norm  # absent when skipped: step means leave it out
    check_loss(loss_value, grad_norm, prefix)
    out[prefix + SKIPPED_STEPS] = float(skip)
    out[prefix + "lr"] = float(lr)
    return out


class _Sums:
    """The micro-batches' loss and metric terms, summed where they are (on the GPU: no host
    sync per micro-batch, whose wait idles the GPU while the next forward is launched) and
    read back once, in one copy."""

    def __init__(self) -> None:
        self.values: dict[str, Tensor | float] = defaultdict(float)

    def add(self, key: str, value: Tensor | float, counted: bool) -> None:
        if not counted:
            self.values[key] += 0.0
        elif isinstance(value, Tensor):
            self.values[key] = self.values[key] + value.detach().double().reshape(())
        else:
            self.values[key] += float(value)

    def floats(self) -> dict[str, float]:
        out = {k: v for k, v in self.values.items() if not isinstance(v, Tensor)}
        held = {k: v for k, v in self.values.items() if isinstance(v, Tensor)}
        for device in {v.device for v in held.values()}:
            keys = [k for k, v in held.items() if v.device == device]
            out.update(zip(keys, torch.stack([held[k] for k in keys]).tolist(), strict=True))
        return {k: out[k] for k in self.values}


def count_skip(consecutive: int, skip: bool, limit: int, prefix: str = "") -> int:
    """The run of consecutively skipped steps after this one; raises `NonFiniteError` once
    it reaches `limit` (train.max_consecutive_skipped_steps): training cannot recover."""
    consecutive = consecutive + 1 if skip else 0
    if consecutive >= limit:
        raise NonFiniteError(
            f"{prefix or 'actor '}gradient norm was not finite for {consecutive} "
            "optimizer steps in a row (train.max_consecutive_skipped_steps); the weights "
            "are those before the first of them"
        )
    return consecutive


def check_loss(loss_value: float, grad_norm: float, prefix: str = "") -> None:
    """A non-finite step loss fails the step (its optimizer step was not taken)."""
    if not math.isfinite(loss_value):
        raise NonFiniteError(
            f"{prefix or 'actor '}loss is {loss_value} (grad norm {grad_norm}); the optimizer "
            f"step was not taken. Look for NaN/inf advantages, log-probs or a custom loss"
        )
