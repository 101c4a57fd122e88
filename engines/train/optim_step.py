"""One optimizer step over a global batch split into micro-batches, shared by actor and
critic: zero grads, accumulate scaled micro-batch losses, clip, step, advance the LR."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.train.distributed import DataParallel

MicroBatchLoss = Callable[[list[int]], tuple[Tensor, dict[str, Tensor]]]


@dataclass(slots=True)
class Optimized:
    """A trainable module with its optimizer and LR scheduler. `module` is what runs the
    forward (DDP-wrapped when data parallel); `params` what is clipped."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    clip_grad: float


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
            for key, value in terms.items():
                totals[prefix + key] += float(value)
    params = [p for p in opt.module.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, opt.clip_grad)
    lr = opt.optimizer.param_groups[0]["lr"]
    opt.optimizer.step()
    opt.scheduler.step()
    out = dp.sum_metrics(dict(totals), device)
    out[prefix + "grad_norm"] = float(grad_norm)
    out[prefix + "lr"] = float(lr)
    return out
