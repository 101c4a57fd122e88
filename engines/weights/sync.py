"""What trainer and engines share to move weights: encodings, buckets, checksums, the group.

- `encode_named_tensors` / `decode_named_tensors`: the payload of SGLang's
  `/update_weights_from_tensor` `serialized_named_tensors` entries. rollflow's encoding is
  base64 (ASCII) of `torch.save(list[(name, tensor)])` bytes, loaded back with
  `weights_only=True` (no pickled code runs); SGLang's own is its MultiprocessingSerializer.
- `buckets`: split named tensors into groups of about `update_weight_buffer_size` bytes.
- `WeightUpdateGroup`: a torch.distributed process group of its own (TCPStore + gloo on CPU
  or NCCL on GPU), never the default group, so a trainer using DDP/FSDP is not disturbed.
  The trainer is rank 0, engines are ranks `rank_offset`.. as in SGLang.
- `weights_checksum`: sha256 over names, dtypes, shapes and bytes, for
  `check_weight_update_equal` (trainer and engine must hash the same way).
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

NamedTensors = Sequence[tuple[str, torch.Tensor]]
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype in `dtypes` (e.g. "bfloat16")."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"dtype {name!r} is not one of {sorted(_DTYPES)}")
    return dtype


def encode_named_tensors(named: NamedTensors) -> str:
    buffer = io.BytesIO()
    torch.save([(n, t.detach().cpu().contiguous()) for n, t in named], buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    try:
        raw = base64.b64decode(payload, validate=True)
        items = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as err:
        raise ValueError(f"serialized_named_tensors entry is not base64 torch.save: {err}") from err
    if not isinstance(items, list) or not all(
        isinstance(i, tuple | list) and len(i) == 2 and isinstance(i[1], torch.Tensor)
        for i in items
    ):
        raise ValueError("serialized_named_tensors entry must hold a list of (name, tensor)")
    return [(str(n), t) for n, t in items]


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Consecutive groups of at most `bucket_bytes` (a larger tensor goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def weights_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        t = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{dtype_name(t.dtype)}|{tuple(tensor.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class WeightUpdateGroup:
    """A standalone process group for weight broadcast (rank 0 is the trainer)."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = "weight_update_group",
        timeout_s: float = 300.0,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(
            master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
        )
        self._store = store
        prefixed = dist.PrefixStore(group_name, store)
        self.group: Any  # a c10d backend object, used directly (not registered as a group)
        if backend == "nccl":
            nccl = dist.ProcessGroupNCCL  # absent from CPU-only torch builds
            options = nccl.Options()
            options._timeout = timeout
            self.group = nccl(prefixed, rank, world_size, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            self.device = torch.device("cpu")
        self.name, self.rank, self.world_size, self.backend = group_name, rank, world_size, backend

    def broadcast(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """One broadcast per tensor, in order (SGLang's per-parameter protocol)."""
        works = [self.group.broadcast(t, src) for t in tensors]
        for work in works:
            work.wait()

    def receive(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> list[tuple[str, torch.Tensor]]:
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes, shapes differ in length: {len(names)}/{len(dtypes)}/{len(shapes)}"
            )
        tensors = [
            torch.empty(list(shape), dtype=parse_dtype(d), device=self.device)
            for d, shape in zip(dtypes, shapes, strict=True)
        ]
        self.broadcast(tensors)
        return list(zip(names, tensors, strict=True))

    def destroy(self, abort: bool = False) -> None:
        """Leave the group: `shutdown` when every rank leaves together (a sender's close),
        `abort` for a leftover whose other ranks are gone (a restarted trainer's old group),
        which waits for no peer."""
        leave = getattr(self.group, "abort" if abort else "shutdown", None)
        if callable(leave):
            leave()
