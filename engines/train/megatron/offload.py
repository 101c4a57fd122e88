"""Offload / onload of megatron models and distributed optimizers (colocated runs).

With the distributed optimizer every trained parameter is a view into its DDP buffer's flat
`param_data` (and `main_grad` into `grad_data`); in float32 the optimizer's shards are views
of those too. So the buffers' *storage* is what moves: copied out and resized to 0 on offload,
resized back and refilled on onload, and every view (parameters, optimizer shards, bucket
views) is valid again without being rebuilt. Gradients are not kept (every step starts by
zeroing them). Optimizer tensors that own their memory (Adam moments, bf16 runs' float32
main parameters) move by reassigning `.data` or the state entry, keeping their identity.
Frozen models (reference, teacher) move parameter by parameter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from engines.train.megatron import parallel


def _buffers(ddp: Any) -> list[Any]:
    return list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", []))


def _inner(optimizer: Any) -> list[Any]:
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


@dataclass
class Offloaded:
    """CPU copies of one trained part's flat parameter buffers while it is offloaded."""

    params: list[Tensor] = field(default_factory=list)


def _cpu_copy(t: Tensor) -> Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
    return out.copy_(t)


def offload_part(ddp: Any, optimizer: Any) -> Offloaded:
    """Free the GPU memory of a DDP-wrapped model and its optimizer (see module doc)."""
    saved = Offloaded()
    aliased = set()
    for buf in _buffers(ddp):
        if buf.param_data is not None:
            aliased.add(buf.param_data.untyped_storage().data_ptr())
    for inner in _inner(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if p.untyped_storage().data_ptr() not in aliased:
                    p.data = p.data.to("cpu")
        for state in inner.state.values():
            for k, v in state.items():
                if isinstance(v, Tensor) and k != "step":
                    state[k] = v.to("cpu")
    for buf in _buffers(ddp):
        if buf.param_data is not None:
            saved.params.append(_cpu_copy(buf.param_data))
            buf.param_data.untyped_storage().resize_(0)
        if buf.grad_data is not None:
            buf.grad_data.untyped_storage().resize_(0)
    return saved


def onload_part(ddp: Any, optimizer: Any, saved: Offloaded) -> None:
    """Undo `offload_part` onto the current CUDA device."""
    device = parallel.current_device()
    copies = iter(saved.params)
    for buf in _buffers(ddp):
        if buf.param_data is not None:
            data = buf.param_data
            data.untyped_storage().resize_(data.numel() * data.element_size())
            data.copy_(next(copies), non_blocking=True)
        if buf.grad_data is not None:
            grad = buf.grad_data
            grad.untyped_storage().resize_(grad.numel() * grad.element_size())
            grad.zero_()
    for inner in _inner(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                if p.device.type == "cpu":
                    p.data = p.data.to(device, non_blocking=True)
        for state in inner.state.values():
            for k, v in state.items():
                if isinstance(v, Tensor) and k != "step":
                    state[k] = v.to(device, non_blocking=True)


def move_frozen(model: Any, device: torch.device | str) -> None:
    """A frozen (not DDP-wrapped) model's parameters to `device`."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(device)
