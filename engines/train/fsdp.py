"""FSDP2 for the torch trainer (`train.strategy: fsdp2`): torch's `fully_shard` over the
train group's process group.

Each decoder layer is one FSDP unit and the model's root (embeddings, final norm, head) one
more: a rank holds 1/N of every parameter, gradient and AdamW state, and gathers one layer
at a time for its forward and its backward (reduce-scattering that layer's gradient after).
What that asks of the rest of the trainer:

- every rank must run the same number of forwards and backwards (each is a collective), so
  a rank with fewer micro-batches pads with uncounted stand-ins (`pad_micro_batches`);
- the weights leave the trainer whole: `full_state_dict` gathers each tensor, on every rank
  in the same order (the engines' export, the HF checkpoint rank 0 writes);
- the optimizer state is saved sharded, with `torch.distributed.checkpoint` (DCP), which
  loads it back on any number of ranks.

Gradients are averaged over the ranks, as DDP's are, so the trainer's loss scaling
(`distributed.py`) holds for both.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from engines.train.step_model import MicroBatch
from engines.train.torch_models import decoder_layers

OPTIMIZER_DCP_DIR = "optimizer_dcp"
CRITIC_OPTIMIZER_DCP_DIR = "critic_optimizer_dcp"


def shard_model(
    model: torch.nn.Module, param_dtype: torch.dtype | None = None, cpu_offload: bool = False
) -> torch.nn.Module:
    """`model` sharded in place: each decoder layer, then the root. `param_dtype` (bfloat16)
    is the dtype of the gathered parameters the forward computes with; gradients are
    reduced in float32 into float32 shards, the master weights."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=precision, offload_policy=offload)
    fully_shard(model, mp_policy=precision, offload_policy=offload)
    return model


def _is_sharded(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def full_tensor(t: Tensor, device: torch.device) -> Tensor:
    """`t` whole (a collective for a sharded tensor). A CPU-offloaded shard is gathered on
    `device`, where the group's backend (NCCL) can reach it."""
    if not _is_sharded(t):
        return t
    if t.device != device and dist.get_backend() != "gloo":
        t = t.to(device)
    return t.full_tensor()  # type: ignore[attr-defined]


@torch.no_grad()
def full_state_dict(model: torch.nn.Module, device: torch.device) -> dict[str, Tensor]:
    """`model.state_dict()` with every tensor whole, on every rank (an all-gather per
    tensor, so every rank must call it at the same point). Every rank gets them: colocated
    with one rank per engine GPU, each rank hands its own GPU's engine a copy."""
    return {name: full_tensor(t, device) for name, t in model.state_dict().items()}


def local_tensor(t: Tensor) -> Tensor:
    """This rank's shard of `t` (`t` itself when it is not sharded)."""
    return t.to_local() if _is_sharded(t) else t  # type: ignore[attr-defined]


def nonfinite_names(named: Iterable[tuple[str, Tensor]], device: torch.device) -> list[str]:
    """Names of the sharded tensors holding NaN/inf on any rank; the same list on every rank
    (one all-reduce), so that all of them fail a check together."""
    pairs = list(named)
    if not pairs:
        return []
    flags = torch.stack([
        (~torch.isfinite(local_tensor(t))).any().to(device=device, dtype=torch.int32)
        for _, t in pairs
    ])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [name for (name, _), bad in zip(pairs, flags.tolist(), strict=True) if bad]


def max_over_ranks(count: int, device: torch.device) -> int:
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def pad_micro_batches(micro_batches: list[MicroBatch], count: int) -> list[MicroBatch]:
    """`micro_batches` and uncounted stand-ins (the first one's rows, loss times 0) up to
    `count`: every rank then runs `count` forwards and backwards."""
    if len(micro_batches) >= count:
        return micro_batches
    stand_in = MicroBatch(micro_batches[0].rows, counted=False)
    return micro_batches + [stand_in] * (count - len(micro_batches))


def move_sharded_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
) -> None:
    """A sharded model and its optimizer state to `device` (colocation's offload and onload).
    `module.to` is FSDP2's own move: it reshards, and swaps each parameter's shard in place,
    so the optimizer keeps holding the same parameters (setting `.data` of a sharded
    parameter to another device is refused). The last step's gradients are dropped (the
    next step zeroes them anyway)."""
    for param in module.parameters():
        param.grad = None
    module.to(device)
    if optimizer is None:
        return
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, Tensor) and key != "step":  # Adam's step stays on the CPU
                state[key] = value.to(device, non_blocking=True)


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Every rank writes its shard of the optimizer state to the DCP directory `path`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """The optimizer state `save_optimizer` wrote, resharded to this group's ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
