"""Colocated weight sync in SGLang's own wire format: CUDA IPC handles, not bytes.

When trainer and engine share a GPU, `/update_weights_from_tensor` need not carry weights:
each `serialized_named_tensors` entry (one per engine TP rank) is base64 of a
`ForkingPickler` dump -- SGLang's `MultiprocessingSerializer` -- in which a CUDA tensor is a
CUDA IPC handle of a few hundred bytes. With `load_format: "flattened_bucket"` the entry
holds `{"flattened_tensor": flat, "metadata": [...]}`: one buffer per bucket, so one handle
to open, as in SGLang's `weight_sync/tensor_bucket.py`.

Both ends, and how each stays compatible with real SGLang:
- `serialize_bucket` (trainer): tensors of one dtype are flattened in that dtype, which both
  SGLang bucket readers accept (older ones reshape the slice, newer ones `.view(dtype)` it).
  The tensor's device travels as its UUID, as SGLang's `monkey_patch_torch_reductions` does,
  so processes that number GPUs differently (Ray sets `CUDA_VISIBLE_DEVICES` per actor) open
  the same memory. Metadata pickles as `types.SimpleNamespace` (attribute access, inside
  SGLang's `SafeUnpickler` allow-list) because SGLang's own class is not importable here.
- `deserialize_entry` (engine): an unpickler that resolves only an exact list of globals --
  torch's CUDA tensor rebuild (mapped to ours, which turns a UUID back into a device index),
  dtypes, `torch.Size`, and the metadata classes -- so a payload can rebuild tensors and
  nothing else. A payload from SGLang's or slime's serializer is accepted too.

The sender keeps each bucket alive until the update has finished (SGLang answers before its
copy is done); the engine copies the tensors into its weights and synchronizes before it
answers. CPU weights keep the safe `torch.save` format of `engines.weights.sync`.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.multiprocessing import reductions

from engines.weights.sync import decode_named_tensors

NamedTensors = Sequence[tuple[str, torch.Tensor]]
FLATTENED_BUCKET = "flattened_bucket"
_DEVICE_ARG = 6  # position of the device in torch's rebuild_cuda_tensor arguments
_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8",
                "bool")


class WeightPayloadError(ValueError):
    """A `serialized_named_tensors` entry that is not a bucket of CUDA tensors."""


@dataclass(frozen=True)
class FlattenedTensorMetadata:
    """Where one named tensor lies in a flattened bucket (SGLang's field names)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __reduce__(self) -> tuple[Any, ...]:
        return (types.SimpleNamespace, (), dict(vars(self)))


def flatten_bucket(named: NamedTensors) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """One contiguous tensor (the bucket's dtype) and where each named tensor lies in it."""
    if not named:
        raise ValueError("cannot flatten an empty bucket")
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) != 1:
        raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, dtypes))}")
    metadata, start = [], 0
    for name, tensor in named:
        numel = tensor.numel()
        metadata.append(FlattenedTensorMetadata(name, tuple(tensor.shape), tensor.dtype, start,
                                                start + numel, numel))
        start += numel
    flat = torch.cat([t.detach().reshape(-1) for _, t in named])
    return flat, metadata


def unflatten_bucket(flat: torch.Tensor, metadata: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
    """The named views of a bucket, checked against its size; a uint8 bucket (newer SGLang
    senders mix dtypes that way) is viewed as each tensor's dtype."""
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise WeightPayloadError("flattened_tensor must be a 1-d tensor")
    named = []
    for meta in metadata:
        name, dtype, shape = getattr(meta, "name", None), getattr(meta, "dtype", None), getattr(
            meta, "shape", None)
        start, end = getattr(meta, "start_idx", None), getattr(meta, "end_idx", None)
        if not (isinstance(name, str) and isinstance(dtype, torch.dtype)
                and isinstance(start, int) and isinstance(end, int)
                and 0 <= start <= end <= flat.numel() and shape is not None):
            raise WeightPayloadError(f"bad bucket metadata entry {meta!r}")
        part = flat[start:end]
        if part.dtype != dtype:
            part = part.view(dtype) if flat.dtype == torch.uint8 else part.to(dtype)
        named.append((name, part.reshape(tuple(shape))))
    return named


def _device_uuid(device: int | str) -> str:
    return device if isinstance(device, str) else str(torch.cuda.get_device_properties(device).uuid)


def _device_index(device: int | str) -> int:
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    raise WeightPayloadError(f"no visible CUDA device has uuid {device!r}")


def _reduce_cuda_tensor(tensor: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple]:
    if not tensor.is_cuda:
        raise WeightPayloadError("CUDA IPC payloads hold CUDA tensors only")
    rebuild, args = reductions.reduce_tensor(tensor)
    return rebuild, (*args[:_DEVICE_ARG], _device_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    if len(args) <= _DEVICE_ARG:
        raise WeightPayloadError("truncated CUDA tensor handle")
    args = (*args[:_DEVICE_ARG], _device_index(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return rebuild(*args)


def serialize_cuda(obj: Any) -> str:
    """SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)` for CUDA tensors."""
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table[torch.Tensor] = _reduce_cuda_tensor
    pickler.dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def serialize_bucket(named: NamedTensors) -> tuple[str, torch.Tensor]:
    """One `serialized_named_tensors` entry for `load_format: "flattened_bucket"` (handles
    on this process's GPU; the sender picks which entry each TP rank gets) and the flat
    tensor, which the caller keeps alive until the engine has copied it."""
    flat, metadata = flatten_bucket(named)
    return serialize_cuda({"flattened_tensor": flat, "metadata": metadata}), flat


_METADATA_CLASSES = ("sglang.srt.weight_sync.tensor_bucket", "engines.weights.cuda_ipc",
                     "types")
_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "Size"): torch.Size,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "TypedStorage"): torch.TypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
    **{(module, "FlattenedTensorMetadata"): types.SimpleNamespace for module in _METADATA_CLASSES},
    ("types", "SimpleNamespace"): types.SimpleNamespace,
    **{("torch", name): getattr(torch, name) for name in _DTYPE_NAMES},
}


class _WeightUnpickler(pickle.Unpickler):
    """Resolves only the globals a bucket of CUDA tensors needs; anything else is refused
    by name (pickle would otherwise import and call whatever the payload names)."""

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise WeightPayloadError(
                f"serialized_named_tensors names {module}.{name}, which is not a tensor rebuild")
        return found


class _Anything:
    """Stands in for every global while `payload_globals` walks a payload."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def payload_globals(payload: str | bytes) -> set[str]:
    """The `module.name` globals a payload names, read without resolving any of them."""
    found: set[str] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            found.add(f"{module}.{name}")
            return _Anything

    raw = base64.b64decode(payload) if isinstance(payload, str) else payload
    Recorder(io.BytesIO(raw)).load()
    return found


def deserialize_entry(entry: str | bytes) -> Any:
    """One `serialized_named_tensors` entry, through the allow-list unpickler."""
    try:
        raw = base64.b64decode(entry, validate=True) if isinstance(entry, str) else entry
    except binascii.Error as err:
        raise WeightPayloadError(f"serialized_named_tensors entry is not base64: {err}") from err
    try:
        return _WeightUnpickler(io.BytesIO(raw)).load()
    except WeightPayloadError:
        raise
    except Exception as err:
        raise WeightPayloadError(f"serialized_named_tensors entry does not unpickle: {err}") from err


def is_pickle(entry: str) -> bool:
    """A MultiprocessingSerializer entry (a pickle) rather than base64 `torch.save` (a zip)."""
    return base64.b64decode(entry[:8] + "=" * (-len(entry[:8]) % 4))[:1] == b"\x80"


def named_tensors_from_entry(entry: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a `serialized_named_tensors` entry: SGLang's format
    (flattened bucket or list of CUDA tensors), or a CPU sender's safe `torch.save`."""
    if load_format != FLATTENED_BUCKET and not is_pickle(entry):
        return decode_named_tensors(entry)
    decoded = deserialize_entry(entry)
    if load_format == FLATTENED_BUCKET:
        if not isinstance(decoded, dict) or set(decoded) != {"flattened_tensor", "metadata"}:
            raise WeightPayloadError(
                "a flattened_bucket entry holds {'flattened_tensor', 'metadata'}")
        return unflatten_bucket(decoded["flattened_tensor"], decoded["metadata"])
    if not isinstance(decoded, list) or not all(
        isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor) for item in decoded
    ):
        raise WeightPayloadError("serialized_named_tensors entry must hold a list of (name, tensor)")
    return [(name, tensor) for name, tensor in decoded]
