"""Data parallelism for the torch backend: DDP over an initialised `torch.distributed` group.

The backend never starts processes: a launcher (torchrun, or one Ray actor per GPU) calls
`init_process_group`, and every rank builds its backend with the same config and receives
the same rollout batch. Each optimizer step's samples are then split by rank; every rank
computes the step's denominator from the whole step (it has all samples), so

    sum over ranks and micro-batches of (micro-batch loss)  ==  the step's loss.

DDP *averages* gradients over ranks, so each rank's loss is multiplied by the world size to
turn that average back into the sum; FSDP2 (`train.strategy: fsdp2`, `fsdp.py`) averages
its reduce-scattered gradients alike. Without an initialised group (the CPU default) all of
this collapses to one rank and no wrapping; FSDP2 shards whenever a group is initialised,
on one rank too (a one-GPU check of its code path). With `train.context_parallel` = N the
samples are split over world / N shares instead, each trained by N consecutive ranks that
split its sequences (`context_parallel.py`); the scaling above holds unchanged.

`init_data_parallel` is what a train-group rank (`train_group.py`) calls before building its
backend: gloo on CPU, NCCL on GPU (Ray gives each rank one GPU, so it is device 0), with
rank 0's address and port as the rendezvous.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True, slots=True)
class DataParallel:
    rank: int = 0
    world_size: int = 1
    strategy: str = "ddp"  # train.strategy: ddp | fsdp2
    grouped: bool = False  # a process group is initialised
    context_parallel: int = 1  # train.context_parallel: consecutive ranks share samples

    @classmethod
    def current(cls, strategy: str = "ddp", context_parallel: int = 1) -> DataParallel:
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), strategy, grouped=True,
                       context_parallel=context_parallel)
        return cls(strategy=strategy, context_parallel=context_parallel)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def data_rank(self) -> int:
        """Which share of a step's samples this rank trains: the ranks of a context group
        (`context_parallel.py`) train the same samples, each its part of every sequence."""
        return self.rank // self.context_parallel

    @property
    def data_size(self) -> int:
        return max(self.world_size // self.context_parallel, 1)

    @property
    def counts_metrics(self) -> bool:
        """Whether this rank's loss terms count in the step's metrics: a context group's
        ranks all compute the whole loss of their samples, so its first rank speaks for it."""
        return self.rank % self.context_parallel == 0

    @property
    def sharded(self) -> bool:
        """FSDP2: parameters, gradients and optimizer state split across the group."""
        return self.strategy == "fsdp2" and self.grouped

    def wrap(
        self, module: torch.nn.Module, device: torch.device,
        param_dtype: torch.dtype | None = None, cpu_offload: bool = False,
    ) -> torch.nn.Module:
        """`module` as the ranks train it: sharded in place (fsdp2; the optimizer must be
        built after, over its sharded parameters), DDP-wrapped, or as is on one rank."""
        if self.sharded:
            from engines.train.fsdp import shard_model

            return shard_model(module, param_dtype, cpu_offload)
        if not self.enabled:
            return module
        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)

    @contextlib.contextmanager
    def no_sync(self, module: torch.nn.Module, skip: bool) -> Iterator[None]:
        """Skip DDP's gradient all-reduce for all but a step's last micro-batch."""
        if skip and isinstance(module, DistributedDataParallel):
            with module.no_sync():
                yield
        else:
            yield

    def gather_scores(self, mine: list[int], scores: list[Tensor], total: int) -> list[Tensor]:
        """Every data rank's scores (`mine`: the indices of this rank's, `data_shares`) in
        sample order, on every rank: exact copies, so the ranks hold the same numbers."""
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, (mine, [t.numpy() for t in scores]))
        result = [torch.empty(0)] * total
        for indices, values in parts:
            for i, v in zip(indices, values, strict=True):
                result[i] = torch.from_numpy(v)
        return result

    def sum_metrics(self, totals: dict[str, float], device: torch.device) -> dict[str, float]:
        """Sum metric totals over ranks (each rank holds its micro-batches' share)."""
        if not self.enabled or not totals:
            return totals
        keys = sorted(totals)
        t = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist(), strict=True))


def data_shares(count: int, size: int, groups: list[int] | None = None) -> list[list[int]]:
    """Which of `count` samples each of `size` data ranks scores: strided, or with `groups`
    (each sample's group, for shared prompts) whole groups strided in order of appearance."""
    if groups is None:
        return [list(range(r, count, size)) for r in range(size)]
    order = {g: k for k, g in enumerate(dict.fromkeys(groups))}
    return [[i for i, g in enumerate(groups) if order[g] % size == r] for r in range(size)]


def rendezvous_address() -> tuple[str, int]:
    """This node's IP and a free port on it: where rank 0 hosts the process-group store."""
    import ray

    from engines.process import free_port

    ip = ray.util.get_node_ip_address()
    return ip, free_port(ip)


def process_group_backend(cuda: bool, cpu_collectives: bool) -> str:
    """NCCL on GPUs, gloo on CPUs; both where GPU ranks also reduce CPU tensors (FSDP2's CPU
    offload: the gradient norm of shards that live on the CPU), which NCCL refuses with
    "No backend type associated with device type cpu"."""
    if not cuda:
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"


def init_data_parallel(
    master_addr: str, master_port: int, rank: int, world_size: int, timeout_s: float = 1800.0,
    cpu_collectives: bool = False,
) -> None:
    """Join the default process group (blocks until all `world_size` ranks are in)."""
    if dist.is_initialized():
        return
    os.environ.update(
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK="0",
    )
    cuda = torch.cuda.is_available()
    backend = process_group_backend(cuda, cpu_collectives)
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
        world_size=world_size, timeout=timedelta(seconds=timeout_s),
    )
