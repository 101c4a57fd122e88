"""SGLang's `/update_weights_from_tensor` format as the colocated weight sync speaks it.

What a CPU can check: the request body field by field against SGLang's
`UpdateWeightsFromTensorReqInput`, the flattened bucket's layout, that the metadata pickles
only into globals SGLang's `SafeUnpickler` admits, and that the engine's unpickler refuses
anything that is not a tensor rebuild (before any weight changes). The CUDA IPC round trip
itself is tests/gpu/test_cuda_ipc_sync.py.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
import types
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from engines.train.train_actor import TrainActor
from engines.weights.cuda_ipc import (
    FLATTENED_BUCKET,
    WeightPayloadError,
    deserialize_entry,
    flatten_bucket,
    is_pickle,
    named_tensors_from_entry,
    payload_globals,
    unflatten_bucket,
)
from engines.weights.sender import (
    PushLayout,
    TensorWeightSender,
    WeightSyncError,
    tensor_update_body,
)
from engines.weights.sync import decode_named_tensors, encode_named_tensors
from tests.support.configs import small_config
from tests.support.engines import embedded_engine
from tests.support.fakes import ExportingBackend, RecordingEngine


@dataclass
class UpdateWeightsFromTensorReqInput:
    """SGLang's request (managers/io_struct.py), its fields, types and defaults as of 2026."""

    serialized_named_tensors: list[str | bytes] = field(default_factory=list)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    disable_draft_model: bool | None = None
    torch_empty_cache: bool = False


# Module prefixes SGLang's SafeUnpickler admits that a weight payload can need.
SGLANG_ADMITS = ("builtins.", "collections.", "copyreg.", "types.", "torch.",
                 "multiprocessing.reduction.", "sglang.srt.weight_sync.tensor_bucket.",
                 "sglang.srt.utils.")


def _type_ok(value: Any, annotation: str) -> bool:
    checks = {
        "list[str | bytes]": lambda v: isinstance(v, list) and all(isinstance(e, str | bytes) for e in v),
        "str | None": lambda v: v is None or isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        "bool | None": lambda v: v is None or isinstance(v, bool),
    }
    return checks[annotation](value)


@pytest.mark.parametrize("load_format", [None, FLATTENED_BUCKET])
def test_request_body_is_sglang_update_weights_from_tensor(load_format: str | None) -> None:
    body = tensor_update_body(["aGk="], 7, load_format)
    spec = {f.name: f for f in fields(UpdateWeightsFromTensorReqInput)}
    assert set(body) <= set(spec), set(body) - set(spec)
    for name, value in body.items():
        assert _type_ok(value, str(spec[name].type)), (name, value, spec[name].type)
    # SGLang builds its dataclass from the JSON: every field it requires is present
    required = [f.name for f in spec.values()
                if f.default is MISSING and f.default_factory is MISSING]
    assert set(required) <= set(body)
    parsed = UpdateWeightsFromTensorReqInput(**body)
    assert parsed.weight_version == "7" and parsed.load_format == load_format
    assert parsed.flush_cache is False  # flushed once after the last bucket


def test_flattened_bucket_layout_and_round_trip() -> None:
    named = [("a", torch.randn(3, 4, dtype=torch.bfloat16)), ("b", torch.randn(5, dtype=torch.bfloat16))]
    flat, metadata = flatten_bucket(named)
    assert flat.dtype == torch.bfloat16 and flat.shape == (17,)
    assert [(m.name, m.start_idx, m.end_idx, m.numel, m.shape) for m in metadata] == [
        ("a", 0, 12, 12, (3, 4)), ("b", 12, 17, 5, (5,))]
    for (name, tensor), (got_name, got) in zip(named, unflatten_bucket(flat, metadata), strict=True):
        assert name == got_name and torch.equal(tensor, got)
    with pytest.raises(ValueError, match="one dtype"):
        flatten_bucket([("a", torch.zeros(2)), ("b", torch.zeros(2, dtype=torch.bfloat16))])


def test_a_uint8_bucket_of_mixed_dtypes_is_read_as_newer_sglang_writes_it() -> None:
    a, b = torch.randn(2, 3), torch.randn(4, dtype=torch.bfloat16)
    raw = [t.reshape(-1).view(torch.uint8) for t in (a, b)]
    meta = [types.SimpleNamespace(name="a", shape=a.shape, dtype=a.dtype, start_idx=0,
                                  end_idx=raw[0].numel(), numel=raw[0].numel()),
            types.SimpleNamespace(name="b", shape=b.shape, dtype=b.dtype, start_idx=raw[0].numel(),
                                  end_idx=raw[0].numel() + raw[1].numel(), numel=raw[1].numel())]
    got = dict(unflatten_bucket(torch.cat(raw), meta))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def test_metadata_pickles_into_globals_sglang_admits_and_reads_back() -> None:
    _, metadata = flatten_bucket([("w", torch.zeros(2, 2, dtype=torch.bfloat16))])
    payload = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    names = payload_globals(payload)
    assert names == {"types.SimpleNamespace", "torch.bfloat16"}
    assert all(any(n.startswith(p) for p in SGLANG_ADMITS) for n in names)
    back = deserialize_entry(base64.b64encode(payload).decode())
    assert [(m.name, m.shape, m.dtype, m.start_idx, m.end_idx) for m in back] == [
        ("w", (2, 2), torch.bfloat16, 0, 4)]


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/rollflow-pwned",))


@pytest.mark.parametrize("obj", [_Evil(), eval], ids=["os.system", "builtins.eval"])
def test_the_engine_unpickler_refuses_anything_but_tensor_rebuilds(obj: Any) -> None:
    buffer = io.BytesIO()
    pickle.Pickler(buffer).dump(obj)
    entry = base64.b64encode(buffer.getvalue()).decode()
    assert is_pickle(entry)
    with pytest.raises(WeightPayloadError, match="not a tensor rebuild"):
        named_tensors_from_entry(entry, None)


def test_cpu_tensors_keep_the_safe_format() -> None:
    sender = TensorWeightSender(["http://127.0.0.1:9"])
    try:
        [(load_format, payload)] = sender.encode([("w", torch.zeros(2))])
    finally:
        sender.close()
    assert load_format is None and not is_pickle(payload)
    assert payload == encode_named_tensors([("w", torch.zeros(2))])


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_a_tensor_update_carries_one_entry_per_engine_tp_rank(tmp_path: Path, tp_size: int) -> None:
    """SGLang's TP rank k reads `serialized_named_tensors[k]`: the trainer learns the
    engines' TP size from the cluster section, also for one trainer rank on the CPU (rank
    0's payload for every TP rank)."""
    cfg = small_config(f"storage.uri={tmp_path}", "train.update_weight_buffer_size=8",
                       f"cluster.rollout_num_gpus_per_engine={tp_size}")
    trainer = TrainActor(cfg)
    trainer.backend = ExportingBackend(fill=2.0, names=("a", "b"))
    engine = RecordingEngine()
    try:
        assert trainer.push_weights([engine.url]) == [3]
    finally:
        trainer.close_weight_sender()
        engine.close()
    assert [len(b["serialized_named_tensors"]) for b in engine.tensor_updates] == [tp_size] * 2
    for body, name in zip(engine.tensor_updates, ("a", "b"), strict=True):
        [entry] = set(body["serialized_named_tensors"])
        [(got, tensor)] = decode_named_tensors(entry)
        assert got == name and torch.equal(tensor, torch.full((2,), 2.0))
    assert trainer.push_timings()["buckets"] == 2


def test_an_engine_of_another_tp_size_is_refused_before_any_update(tmp_path: Path) -> None:
    """An external SGLang server started with --tp-size 2 against a config that says 1
    would fail inside SGLang at its first update; the sender asks `/get_server_info` and
    names the setting to change instead."""
    cfg = small_config(f"storage.uri={tmp_path}", "cluster.rollout_num_gpus_per_engine=1")
    trainer = TrainActor(cfg)
    trainer.backend = ExportingBackend(fill=2.0, names=("a",))
    matching, other = RecordingEngine(tp_size=1), RecordingEngine(tp_size=2)
    try:
        assert trainer.push_weights([matching.url]) == [3]
        with pytest.raises(WeightSyncError, match="tp_size 2.*rollout_num_gpus_per_engine is 1"):
            trainer.push_weights([matching.url, other.url])
    finally:
        trainer.close_weight_sender()
        matching.close()
        other.close()
    assert other.tensor_updates == [] and len(matching.tensor_updates) == 1


@pytest.mark.parametrize(("colocate", "world", "engines", "tp", "per_rank"), [
    (True, 2, 1, 2, True), (True, 2, 2, 1, True), (True, 8, 2, 4, True),
    (False, 2, 1, 2, False),  # engines on other GPUs: no rank shares one
    (True, 2, 1, 1, False), (True, 4, 1, 2, False),  # not one rank per engine GPU
    (True, 1, 1, 1, False),  # one rank: its payload is the entry anyway
])
def test_each_rank_sends_its_own_entry_only_in_slimes_colocated_layout(
    colocate: bool, world: int, engines: int, tp: int, per_rank: bool
) -> None:
    assert PushLayout.of(colocate, world, engines, tp) == PushLayout(tp, per_rank)


def test_engine_answers_400_naming_the_global_and_keeps_its_weights(tiny_model_dir: str) -> None:
    with embedded_engine(tiny_model_dir) as engine:
        before = engine.weights_checksum()
        buffer = io.BytesIO()
        pickle.Pickler(buffer).dump(_Evil())
        body = {"serialized_named_tensors": [base64.b64encode(buffer.getvalue()).decode()],
                "load_format": FLATTENED_BUCKET, "weight_version": "3"}
        response = httpx.post(f"{engine.url()}/update_weights_from_tensor", json=body, timeout=30)
        assert response.status_code == 400
        assert "posix.system" in response.text or "os.system" in response.text
        bad_format = httpx.post(f"{engine.url()}/update_weights_from_tensor", timeout=30,
                                json={**body, "load_format": "npz"})
        assert bad_format.status_code == 400 and "load_format" in bad_format.text
        assert engine.weights_checksum() == before and engine.weight_version() == 0
        assert not os.path.exists("/tmp/rollflow-pwned")
