"""Process groups, the TP vocab shard, and gathering full weights.

Every rank of a torchrun job builds one `MegatronTrainBackend`; with no torchrun (a single
process) `init_parallel` starts a one-rank NCCL group itself. Megatron is imported lazily.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engines.config.train import check_parallel_sizes
from engines.process import free_port
from engines.train.megatron.hf_convert import (
    expert_tensors,
    merge_ep,
    merge_stages,
    merge_tp_tensor,
    stage_layers,
    tp_split_dim,
)


def init_parallel(tp: int, pp: int, seed: int, ep: int = 1) -> None:
    """torch.distributed (NCCL) + megatron's TP/PP/DP(/EP) groups + its CUDA RNG tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", rank=rank, world_size=world)
    check_parallel_sizes(dist.get_world_size(), tp, pp, ep)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
          ps.get_expert_model_parallel_world_size()) != (tp, pp, ep):
        raise ValueError("megatron is already initialised with a different tp/pp/ep")
    model_parallel_cuda_manual_seed(seed)


def current_device() -> torch.device:
    """This process's CUDA device (the one `init_parallel` selected)."""
    return torch.device("cuda", torch.cuda.current_device())


def tp_vocab_shard(local_vocab: int) -> tuple[Any, int]:
    """(the TP group, or None without TP; the first vocab id of this rank's logit columns)."""
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return None, 0
    return ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank() * local_vocab


def _local_params(model: Any) -> dict[str, Tensor]:
    """Parameters of this rank's (unwrapped) model, detached, where they live; no
    `_extra_state`."""
    return {k: v.detach() for k, v in model.state_dict().items()
            if not k.endswith("_extra_state")}


def _on_host(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.to("cpu", copy=True) for k, v in state.items()}


def gather_full_state(model: Any, num_layers: int) -> dict[str, Tensor]:
    """The full megatron state dict (all TP shards, EP ranks' experts, PP stages) on every
    rank, on CPU."""
    from megatron.core import parallel_state as ps

    local = _local_params(model)
    ep = ps.get_expert_model_parallel_world_size()
    if ep > 1:  # the other EP ranks' experts; the rest is the same on every EP rank
        experts: list[Any] = [None] * ep
        dist.all_gather_object(experts, _on_host(expert_tensors(local)),
                               group=ps.get_expert_model_parallel_group())
        local = merge_ep([{**local, **experts[0]}, *experts[1:]])
    tp = ps.get_tensor_model_parallel_world_size()
    stage = gather_tp(local, ps.get_tensor_model_parallel_group(), tp) if tp > 1 else _on_host(local)
    pp = ps.get_pipeline_model_parallel_world_size()
    start = stage_layers(num_layers, ps.get_pipeline_model_parallel_rank(), pp).start
    stages: list[Any] = [None] * pp
    if pp > 1:
        dist.all_gather_object(stages, (start, stage), group=ps.get_pipeline_model_parallel_group())
    else:
        stages = [(start, stage)]
    return merge_stages(stages)


def gather_tp(local: Mapping[str, Tensor], group: Any, size: int) -> dict[str, Tensor]:
    """One PP stage's full tensors on the host: each TP-split tensor is all-gathered where it
    lives (NCCL on the GPU; the shards of a split tensor have one shape on every rank),
    merged there and copied to the host one at a time, so the device holds one extra
    full tensor at most. Pickling the shards through `all_gather_object` instead took
    most of each push (bench/RESULTS.md, "GPU end to end", parts (f) and (g))."""
    device = current_device() if torch.cuda.is_available() else torch.device("cpu")
    full: dict[str, Tensor] = {}
    for name, tensor in local.items():
        if tp_split_dim(name) is None:  # replicated: every rank holds all of it
            full[name] = tensor.to("cpu", copy=True)
            continue
        shard = tensor.to(device).contiguous()
        parts = [torch.empty_like(shard) for _ in range(size)]
        dist.all_gather(parts, shard, group=group)
        full[name] = merge_tp_tensor(name, parts).to("cpu", copy=True)
    return full


def copy_into(model: Any, weights: Mapping[str, Tensor]) -> None:
    """Copy this rank's shard into the model's parameters, checking names and shapes."""
    params = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    missing = sorted(set(params) - set(weights))
    extra = sorted(set(weights) - set(params))
    if missing or extra:
        raise ValueError(f"weight mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            src = weights[name]
            if src.shape != p.shape:
                raise ValueError(f"{name}: checkpoint {tuple(src.shape)} vs model {tuple(p.shape)}")
            p.copy_(src.to(p.dtype))


def broadcast_from_last_stage(obj: Any) -> Any:
    """Pick the last PP stage's value of `obj` on every stage of its pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(
        box, src=ps.get_pipeline_model_parallel_last_rank(),
        group=ps.get_pipeline_model_parallel_group(),
    )
    return box[0]


def all_gather_dp(obj: Any) -> list[Any]:
    """`obj` of every DP rank, in DP-rank order."""
    from megatron.core import parallel_state as ps

    size = ps.get_data_parallel_world_size()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=ps.get_data_parallel_group())
    return out


def max_over_dp(n: int) -> int:
    """The largest `n` of the DP ranks (their micro-batch counts, say); `n` without EP.

    An MoE layer under expert parallelism exchanges tokens between the EP ranks (all-to-all)
    in every forward, so every rank of an EP group must run as many micro-batches as the
    others, though its share of the samples may need fewer."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_model_parallel_world_size() == 1:
        return n
    box = torch.tensor([n], device=current_device())
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
    return int(box.item())
