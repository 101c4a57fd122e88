"""Trainer side of weight sync: push a model's weights to every engine, SGLang's way.

Each update is   pause_generation -> push weights -> flush_cache -> continue_generation,
then the engines' `get_weight_version` is read back. The push is one of (`train.weight_sync`):

- `tensor`: `/update_weights_from_tensor` per bucket: weights on a GPU go as SGLang's CUDA IPC
  handles (`load_format: "flattened_bucket"`, engines.weights.cuda_ipc: no bytes move, for
  engines that share the trainer's GPU), CPU weights as base64 `torch.save` bytes; one
  `serialized_named_tensors` entry per engine TP rank, each from the trainer rank on that
  rank's GPU where the placement allows it (`PushLayout`);
- `distributed`: the trainer is rank 0 of a process group with the engines (ranks 1..n);
  per bucket it POSTs `/update_weights_from_distributed` (names, dtypes, shapes) to every
  engine and broadcasts the bucket's tensors while those requests wait on the group;
- `disk`: `save_pretrained` into a directory and `/update_weights_from_disk`.

Buckets hold about `update_weight_buffer_size` bytes. Each update leaves where its seconds
went in `timings` (`WeightSender.timings`: the pause, the export, the push's parts, the flush;
`connect_s` for the update that set the group up), which the flow stores as
`broadcast_weights/<key>` metrics. Engines are addressed by URL, so the
same sender works for embedded engines and real SGLang servers. What is sent is always the
base model's HF-named weights, from a `WeightSource`: a train backend (`export_weights`;
megatron's gathers TP shards and PP stages, a collective every rank joins) or an HF model
(merged weights when it trains LoRA adapters, hf_export.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
import torch
import torch.distributed as dist
from torch import Tensor

from engines.config.train import TrainConfig
from engines.process import free_port
from engines.weights.cuda_ipc import FLATTENED_BUCKET, serialize_bucket
from engines.weights.finite import check_finite
from engines.weights.hf_export import NotHFModelError, engine_state_dict, save_hf
from engines.weights.sync import (
    NamedTensors,
    WeightUpdateGroup,
    buckets,
    dtype_name,
    encode_named_tensors,
    weights_checksum,
)


class WeightSyncError(RuntimeError):
    """An engine refused an update, or holds weights other than the trainer's."""


class WeightSource(Protocol):
    """What a sender pushes: the policy's full weights under HF names (any device)."""

    def export_weights(self) -> Mapping[str, Tensor]: ...

    def save_hf(self, path: str) -> None:
        """The same weights as a directory `AutoModelForCausalLM.from_pretrained` loads."""
        ...


class ModuleWeights:
    """An HF (or peft LoRA) model as a `WeightSource`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def export_weights(self) -> Mapping[str, Tensor]:
        return engine_state_dict(self.model)

    def save_hf(self, path: str) -> None:
        save_hf(self.model, path)


Weights = WeightSource | torch.nn.Module


def as_weight_source(weights: Weights) -> WeightSource:
    return ModuleWeights(weights) if isinstance(weights, torch.nn.Module) else weights


class WeightSender(Protocol):
    timings: dict[str, float]
    """Where the last `update` (and the `connect` before it, as `connect_s`) spent its
    seconds, plus counts (`buckets`, `bytes`)."""

    def connect(self) -> None: ...

    def update(self, weights: Weights, version: int) -> list[int]:
        """Push `weights` as `version`; returns each engine's reported version."""
        ...

    def close(self) -> None: ...


class _HTTPSender:
    """The pause / push / flush / continue cycle over every engine, concurrently."""

    def __init__(
        self,
        engine_urls: list[str],
        bucket_bytes: int = 512 * 1024**2,
        pause_mode: str = "abort",
        timeout_s: float = 600.0,
    ) -> None:
        if not engine_urls:
            raise ValueError("weight sync needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in engine_urls]
        self.bucket_bytes, self.pause_mode = bucket_bytes, pause_mode
        self._http = httpx.Client(timeout=timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.urls)))
        self.timings: dict[str, float] = {}
        self._connect_s: float | None = None

    def connect(self) -> None:
        """Nothing to set up for HTTP-only pushes."""

    def _timed(self, key: str, start: float) -> float:
        """Add the seconds since `start` to `timings[key]`; returns now."""
        now = time.perf_counter()
        self.timings[key] = self.timings.get(key, 0.0) + now - start
        return now

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._http.close()

    def post_async(self, path: str, body: dict[str, Any]) -> list[Future[dict[str, Any]]]:
        return [self._pool.submit(self._post, url + path, body) for url in self.urls]

    def post_all(self, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        return [f.result() for f in self.post_async(path, body)]

    def post_each(self, path: str, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`bodies[i]` to engine i, concurrently."""
        futures = [self._pool.submit(self._post, url + path, body)
                   for url, body in zip(self.urls, bodies, strict=True)]
        return [f.result() for f in futures]

    def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self._http.post(url, json=body)
        if response.status_code >= 400:
            raise WeightSyncError(f"{url} -> HTTP {response.status_code}: {response.text[:500]}")
        return dict(response.json()) if response.content.strip() else {}

    def versions(self) -> list[int]:
        def get(url: str) -> int:
            return int(self._http.get(f"{url}/get_weight_version").json()["weight_version"])

        return list(self._pool.map(get, self.urls))

    def update(self, weights: Weights, version: int) -> list[int]:
        connect, self._connect_s = self._connect_s, None  # a connect() since the last update
        self.timings = {} if connect is None else {"connect_s": connect}
        t = time.perf_counter()
        self.post_all("/pause_generation", {"mode": self.pause_mode})
        t = self._timed("pause_s", t)
        try:
            self.push(as_weight_source(weights), version)
            t = self._timed("push_s", t)
            for url in self.urls:  # SGLang refuses while requests hold KV (in_place pause)
                self._http.post(f"{url}/flush_cache")
            t = self._timed("flush_s", t)
        finally:
            self.post_all("/continue_generation", {})
            t = self._timed("continue_s", t)
        versions = self.versions()
        self._timed("versions_s", t)
        return versions

    def push(self, source: WeightSource, version: int) -> None:
        raise NotImplementedError

    def named_buckets(self, source: WeightSource) -> list[NamedTensors]:
        """The source's weights in buckets; `export_s` is the export's time (for megatron a
        collective: gathering TP shards and PP stages, with every rank joining it)."""
        start = time.perf_counter()
        groups = list(buckets(source.export_weights().items(), self.bucket_bytes))
        self._timed("export_s", start)
        self.timings["buckets"] = float(len(groups))
        self.timings["bytes"] = float(sum(t.numel() * t.element_size() for g in groups for _, t in g))
        return groups


@dataclass(frozen=True)
class PushLayout:
    """How the engines' TP ranks meet the trainer's ranks, from the cluster section.

    SGLang's model runner reads `serialized_named_tensors[tp_rank]`, so a tensor update
    carries `tp_size` entries. `per_rank` is slime's colocated layout: the train group has
    `num_engines x tp_size` ranks and trainer rank r shares its GPU (placement bundle r) with
    engine r // tp_size's TP rank r % tp_size, so each rank sends the entry for its own GPU
    and no engine rank opens memory on another GPU. Without it, rank 0's payload is every TP
    rank's entry."""

    tp_size: int = 1
    per_rank: bool = False

    @classmethod
    def of(cls, colocate: bool, world_size: int, num_engines: int, tp_size: int) -> PushLayout:
        return cls(tp_size, colocate and world_size > 1 and world_size == num_engines * tp_size)


RankPayloads = list[tuple[str | None, str]]
"""One rank's (load_format, payload) per request of a bucket."""


class TensorWeightSender(_HTTPSender):
    """`/update_weights_from_tensor`; CUDA buckets are held until the whole update is done,
    because the engine reads the trainer's memory through the handles (and real SGLang
    answers before its copy has finished).

    With `layout.per_rank` every rank of the train group (torch.distributed's default group)
    runs `update`, in the same bucket order (each exports the full weights): rank 0 gathers
    each bucket's payloads, posts engine i the entries of ranks i*tp .. i*tp+tp-1 and runs the
    pause / flush / continue cycle; the others hold their buckets until rank 0's update is
    over (a barrier). A failure on one rank leaves the others inside a collective: the train
    group then kills them all (engines/cluster/train_group.py)."""

    def __init__(self, engine_urls: list[str], bucket_bytes: int = 512 * 1024**2,
                 layout: PushLayout = PushLayout(), **kw: Any) -> None:
        super().__init__(engine_urls, bucket_bytes, **kw)
        if layout.per_rank and dist.get_world_size() != len(self.urls) * layout.tp_size:
            raise ValueError(f"a per-rank push needs {len(self.urls)} engines x TP "
                             f"{layout.tp_size} train ranks, not {dist.get_world_size()}")
        self.layout = layout
        self._held: list[Tensor] = []

    def connect(self) -> None:
        """Check the entries each engine will index: an SGLang server reports its `tp_size`
        in `/get_server_info`, and one that differs from `cluster.rollout_num_gpus_per_engine`
        (external servers, `engine.urls`, are started by the user) would fail inside SGLang
        at its first update. Engines without the route (the embedded one) are not asked."""
        for url, info in zip(self.urls, self._pool.map(self._server_info, self.urls), strict=True):
            reported = info.get("tp_size")
            if isinstance(reported, int) and reported != self.layout.tp_size:
                raise WeightSyncError(
                    f"{url} runs with tp_size {reported}, but cluster.rollout_num_gpus_per_engine"
                    f" is {self.layout.tp_size}: a tensor update carries one entry per engine TP"
                    f" rank, so set it to {reported}")

    def _server_info(self, url: str) -> dict[str, Any]:
        response = self._http.get(f"{url}/get_server_info")
        if response.status_code != 200:
            return {}
        info = response.json()
        return info if isinstance(info, dict) else {}

    def update(self, weights: Weights, version: int) -> list[int]:
        """Rank 0: the cycle, returning the engines' versions; another rank of a per-rank
        layout: its payloads for rank 0, then `[]` once rank 0 is done."""
        try:
            if self.layout.per_rank and dist.get_rank() != 0:
                self.timings = {}
                for bucket in self.named_buckets(as_weight_source(weights)):
                    self.rank_payloads(bucket)
                dist.barrier()
                return []
            versions = super().update(weights, version)
            if self.layout.per_rank:
                dist.barrier()  # the engines have copied: the other ranks may let go
            return versions
        finally:
            self.release()

    def release(self) -> None:
        """Let go of the buckets `encode` made (once the engines have copied them)."""
        if self._held:
            torch.cuda.synchronize()
        self._held.clear()

    def push(self, source: WeightSource, version: int) -> None:
        for bucket in self.named_buckets(source):
            payloads = self.rank_payloads(bucket)
            for k, (load_format, _) in enumerate(payloads[0]):
                bodies = [tensor_update_body(self.entries(payloads, engine, k), version, load_format)
                          for engine in range(len(self.urls))]
                self.post_each("/update_weights_from_tensor", bodies)

    def rank_payloads(self, bucket: NamedTensors) -> list[RankPayloads]:
        """This rank's payloads of `bucket`; on rank 0 of a per-rank layout, every rank's
        (gathered: `gather_s`), each checked to hold the same tensors as rank 0's."""
        mine = self.encode(bucket)
        if not self.layout.per_rank:
            return [mine]
        start = time.perf_counter()
        shape = ([n for n, _ in bucket], [fmt for fmt, _ in mine])
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object((shape, mine), gathered, dst=0)
        self._timed("gather_s", start)
        if gathered is None:
            return [mine]
        for rank, (theirs, _) in enumerate(gathered):
            if theirs != shape:
                raise WeightSyncError(f"train rank {rank} bucketed its weights unlike rank 0")
        return [payloads for _, payloads in gathered]

    def entries(self, payloads: list[RankPayloads], engine: int, request: int) -> list[str]:
        """Engine `engine`'s `serialized_named_tensors`: TP rank j's entry from train rank
        engine * tp_size + j where every rank sent one, else rank 0's for every TP rank."""
        tp = self.layout.tp_size
        if len(payloads) == 1:
            return [payloads[0][request][1]] * tp
        return [payloads[engine * tp + j][request][1] for j in range(tp)]

    def encode(self, bucket: NamedTensors) -> RankPayloads:
        """(load_format, payload) per request: on a GPU machine one flattened bucket of CUDA
        IPC handles per dtype (weights a backend exports on the CPU, as megatron's gather
        does, are copied to this rank's GPU first: far cheaper than their bytes over HTTP);
        without a GPU one safe `torch.save` payload."""
        if not all(t.is_cuda for _, t in bucket):
            if not torch.cuda.is_available():
                return [(None, encode_named_tensors(bucket))]
            bucket = [(n, t.to("cuda", non_blocking=True)) for n, t in bucket]
        by_dtype: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
        for name, tensor in bucket:
            by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
        requests: RankPayloads = []
        for named in by_dtype.values():
            payload, flat = serialize_bucket(named)
            if flat.is_floating_point() and not bool(torch.isfinite(flat).all()):
                check_finite(named, "weights for the engines")  # names them and raises
            self._held.append(flat)
            requests.append((FLATTENED_BUCKET, payload))
        return requests


def tensor_update_body(entries: list[str], version: int, load_format: str | None) -> dict[str, Any]:
    """SGLang's `UpdateWeightsFromTensorReqInput` as JSON; the cache is flushed once at the
    end of the update rather than per bucket."""
    body: dict[str, Any] = {"serialized_named_tensors": entries, "flush_cache": False,
                            "weight_version": str(version)}
    if load_format is not None:
        body["load_format"] = load_format
    return body


class DistributedWeightSender(_HTTPSender):
    """Rank 0 of `group_name`; engine i joins as rank 1 + i."""

    def __init__(
        self,
        engine_urls: list[str],
        bucket_bytes: int = 512 * 1024**2,
        backend: str = "auto",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        group_name: str = "rollflow_weight_update",
        pause_mode: str = "abort",
    ) -> None:
        super().__init__(engine_urls, bucket_bytes, pause_mode)
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        self.backend, self.master_address = backend, master_address
        self.master_port, self.group_name = master_port or free_port(""), group_name
        self.group: WeightUpdateGroup | None = None

    def connect(self) -> None:
        """Engines join while rank 0 creates the store: both sides block until all are in.

        A restarted trainer finds the engines still in its predecessor's group of the same
        name (SGLang refuses a second one: "already registered"), so each engine is first
        asked to drop it; without one that is a 400, ignored. Its seconds are the next
        update's `connect_s`."""
        start = time.perf_counter()
        for leftover in self.post_async(
            "/destroy_weights_update_group", {"group_name": self.group_name, "abort": True}
        ):
            with suppress(WeightSyncError):  # no such group: a first connect
                leftover.result()
        world = len(self.urls) + 1
        joins = [
            self._pool.submit(
                self._post,
                url + "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": self.master_port,
                    "rank_offset": 1 + i,
                    "world_size": world,
                    "group_name": self.group_name,
                    "backend": self.backend,
                },
            )
            for i, url in enumerate(self.urls)
        ]
        self.group = WeightUpdateGroup(
            self.master_address, self.master_port, 0, world, self.backend, self.group_name
        )
        for join in joins:
            join.result()
        self._connect_s = time.perf_counter() - start
        self.timings = {"connect_s": self._connect_s}

    def push(self, source: WeightSource, version: int) -> None:
        """Per bucket: `to_device_s` the copy onto the group's device (megatron exports on
        the CPU), `broadcast_s` rank 0's broadcast until it is done (the first one also sets
        up the communicator: NCCL does that at a group's first collective, so a first
        `first_broadcast_s` far above the later ones' is that set-up), `engines_s` the wait for
        the engines' answers after it (their copy into the model, after the step they are
        in)."""
        if self.group is None:
            raise WeightSyncError("connect() the distributed weight sender first")
        for i, bucket in enumerate(self.named_buckets(source)):
            body = {
                "names": [n for n, _ in bucket],
                "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": self.group_name,
                "weight_version": str(version),
                "flush_cache": False,
            }
            pending = self.post_async("/update_weights_from_distributed", body)
            start = time.perf_counter()
            tensors = [w.detach().to(self.group.device).contiguous() for _, w in bucket]
            start = self._timed("to_device_s", start)
            self.group.broadcast(tensors)
            if self.group.device.type == "cuda":  # NCCL's wait() only orders the stream
                torch.cuda.synchronize(self.group.device)
            if i == 0:
                self.timings["first_broadcast_s"] = time.perf_counter() - start
            start = self._timed("broadcast_s", start)
            for request in pending:
                request.result()
            self._timed("engines_s", start)

    def close(self) -> None:
        if self.group is not None:
            # Both ends tear down at once: NCCL's communicator teardown waits for the peers,
            # so destroying ours only after the engines answer would deadlock.
            pending = self.post_async("/destroy_weights_update_group", {"group_name": self.group_name})
            self.group.destroy()
            self.group = None
            for request in pending:
                request.result()
        super().close()


class DiskWeightSender(_HTTPSender):
    """The fallback: a shared directory both sides see; only the newest version is kept."""

    def __init__(self, engine_urls: list[str], save_dir: str | None = None, **kw: Any) -> None:
        super().__init__(engine_urls, **kw)
        self.save_dir = Path(save_dir or tempfile.mkdtemp(prefix="rollflow-weights-"))
        self._last: Path | None = None

    def push(self, source: WeightSource, version: int) -> None:
        path = self.save_dir / f"v{version:06d}"
        try:
            source.save_hf(str(path))
        except NotHFModelError as err:
            raise WeightSyncError(f"disk weight sync needs a Hugging Face model: {err}") from err
        self.post_all(
            "/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version)}
        )
        if self._last is not None and self._last != path:
            shutil.rmtree(self._last, ignore_errors=True)
        self._last = path


SenderFactory = Callable[[TrainConfig, list[str], PushLayout], WeightSender]
WEIGHT_SENDERS: dict[str, SenderFactory] = {
    "tensor": lambda cfg, urls, layout: TensorWeightSender(
        urls, cfg.update_weight_buffer_size, layout, pause_mode=cfg.weight_update_pause),
    "distributed": lambda cfg, urls, layout: DistributedWeightSender(
        urls, cfg.update_weight_buffer_size, cfg.weight_sync_backend, cfg.weight_sync_master_address,
        pause_mode=cfg.weight_update_pause,
    ),
    "disk": lambda cfg, urls, layout: DiskWeightSender(urls, pause_mode=cfg.weight_update_pause),
}


def build_weight_sender(
    config: TrainConfig, engine_urls: list[str], layout: PushLayout
) -> WeightSender:
    """The sender `train.weight_sync` names; call `connect()` once, `update()` per step.
    `layout` comes from the cluster section (the engines' TP size), which the `train`
    section does not hold; only the tensor sender uses it."""
    factory = WEIGHT_SENDERS.get(config.weight_sync)
    if factory is None:
        raise ValueError(
            f"train.weight_sync {config.weight_sync!r} is not one of {sorted(WEIGHT_SENDERS)}"
        )
    return factory(config, engine_urls, layout)


def check_weight_update_equal(weights: Weights, engine_urls: list[str]) -> str:
    """Raise WeightSyncError unless every engine's weights hash like `weights`; returns it."""
    expected = weights_checksum(as_weight_source(weights).export_weights().items())
    with httpx.Client(timeout=120.0) as http:
        for url in engine_urls:
            response = http.post(f"{url.rstrip('/')}/weights_checker", json={"action": "checksum"})
            got = response.json().get("payload", {}).get("checksum")
            if response.status_code != 200 or got != expected:
                raise WeightSyncError(
                    f"{url}: weights differ from the trainer's ({got} != {expected})"
                )
    return expected
