"""The training side of a run as one long-lived actor around a train backend.

It reads each step's `train.arrow` from the run directory, so a step can be (re)trained from
storage alone, and it knows how to get back to any committed weight version after losing
its state: load the last checkpoint, then replay the committed batches after it, each under
the settings it was trained under (`step_settings.py`).

In a train group (`train_group.py`) there is one TrainActor per rank: each is built with its
rank and the world size, joins the process group in `join_group` (only then is its backend
built, since DDP wraps the model at construction), and trains on the same step as the others.
Every rank saves a checkpoint into one staging path, stored once per disk
(`checkpoint_staging`); rank 0 alone moves LATEST and talks to the engines; where
exporting the weights is a collective (megatron gathers TP shards and PP stages), the other
ranks join that export and return nothing, and colocated with one rank per engine GPU each
rank hands rank 0 the CUDA IPC handles of its own GPU's copy (`PushLayout`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engines.config.run import RunConfig
from engines.process import actor_threads, freeze_actor_heap
from engines.train.checkpoint_staging import fetch_and_load, save_and_store
from engines.train.step_settings import FIXED_AT_BUILD, StepSettings, settings_for_replay
from storage.batch_io import read_samples
from storage.run_layout import RunLayout, step_dir

if TYPE_CHECKING:
    from engines.weights.sender import PushLayout


def _torch_backend(cfg: RunConfig) -> Any:
    from engines.train.torch_backend import TorchTrainBackend

    # a CPU group's ranks on one node train at the same time: they split its cores
    threads = actor_threads(cfg.cluster.actor_num_threads, cfg.cluster.actor_num_gpus_per_node)
    return TorchTrainBackend(
        cfg.train, cfg.algorithm, cfg.rollout.temperature, threads,
        reward_key=cfg.rollout.reward_key,
    )


def _mock_backend(cfg: RunConfig) -> Any:
    from engines.train.mock_backend import MockTrainBackend

    return MockTrainBackend(cfg.train, cfg.algorithm, cfg.rollout.temperature)


def _megatron_backend(cfg: RunConfig) -> Any:
    from engines.train.megatron import MegatronTrainBackend

    return MegatronTrainBackend(
        cfg.train, cfg.algorithm, cfg.rollout.temperature, reward_key=cfg.rollout.reward_key,
        tensor_parallel=cfg.train.tensor_parallel, pipeline_parallel=cfg.train.pipeline_parallel,
        expert_parallel=cfg.train.expert_parallel,
    )


TRAIN_BACKENDS: dict[str, Callable[[RunConfig], Any]] = {
    "torch": _torch_backend,
    "megatron": _megatron_backend,
    "mock": _mock_backend,
}

def collective_export(cfg: RunConfig) -> bool:
    """Whether every rank must join the weight export (`weights`, `push_weights`): a train
    group then calls those on all its ranks, not only on rank 0. Megatron gathers TP shards
    and PP stages; the torch trainer under FSDP2 gathers each parameter's shards."""
    return cfg.train.backend == "megatron" or (
        cfg.train.backend == "torch" and cfg.train.strategy == "fsdp2"
    )


class TrainActor:
    def __init__(self, cfg: RunConfig, rank: int = 0, world_size: int = 1) -> None:
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.layout = RunLayout.open(
            cfg.storage.uri, cfg.storage.run_name, cfg.storage.endpoint_url,
            cfg.storage.store_options(),
        )
        self._backend: Any = None
        self._rendezvous: tuple[str, int] | None = None
        if world_size == 1:
            self._backend = TRAIN_BACKENDS[cfg.train.backend](cfg)
            freeze_actor_heap()  # (a group rank builds its backend, and freezes, on joining)
        self.replayed_steps: list[int] = []
        self._trained_indices: list[int] = []
        self._last_trained: int | None = None
        self._last_metrics: dict[str, float] = {}  # of the step `_last_trained`
        self._sender: Any = None
        self._sender_urls: list[str] = []
        self._push_timings: dict[str, float] = {}
        self._phases: list[str] = []  # offload / onload / train k, in order

    @property
    def backend(self) -> Any:
        if self._backend is None:
            raise RuntimeError(
                f"train rank {self.rank}/{self.world_size} has not joined its group yet"
            )
        return self._backend

    @backend.setter
    def backend(self, value: Any) -> None:
        self._backend = value

    def master_address(self) -> tuple[str, int]:
        """Rank 0: the rendezvous of the group's process group (the same on every call)."""
        from engines.train.distributed import rendezvous_address

        if self._rendezvous is None:
            self._rendezvous = rendezvous_address()
        return self._rendezvous

    def join_group(self, master_addr: str, master_port: int) -> int:
        """Join the process group, then build the backend (DDP-wrapped); idempotent."""
        from engines.train.distributed import init_data_parallel

        if self._backend is None:
            init_data_parallel(master_addr, master_port, self.rank, self.world_size,
                               cpu_collectives=self.cfg.train.fsdp_cpu_offload)
            self._backend = TRAIN_BACKENDS[self.cfg.train.backend](self.cfg)
            freeze_actor_heap()
        return self.rank

    def version(self) -> int:
        return int(self.backend.version)

    def pid(self) -> int:
        """The actor's process, for fault tests (kill -9) and operators."""
        return os.getpid()

    def train(self, rollout_id: int) -> dict[str, float]:
        """Train on step `rollout_id`'s batch; a no-op if the policy is already past it."""
        samples = read_samples(self.layout.store, step_dir(rollout_id), "train.arrow")
        start, cpu_start = time.perf_counter(), time.process_time()
        metrics = dict(self.backend.train(samples, rollout_id))
        metrics["train/seconds"] = time.perf_counter() - start
        metrics["train/cpu_seconds"] = time.process_time() - cpu_start  # all of its threads
        self._phases.append(f"train {rollout_id}")
        if not metrics.get("skipped"):
            self._trained_indices.extend(s.index for s in samples)
            self._last_trained, self._last_metrics = rollout_id, dict(metrics)
        return metrics

    def trained_indices(self) -> list[int]:
        """Sample indices this actor trained on since it started, in order (replays
        included): the evidence that no sample was trained twice or skipped."""
        return list(self._trained_indices)

    def _joins_export(self) -> bool:
        """A rank other than 0 whose backend's export is a collective it must take part in."""
        return self.rank != 0 and collective_export(self.cfg)

    def push_weights(self, engine_urls: list[str]) -> list[int]:
        """Send the current weights to the engines over HTTP + a process group (or disk),
        pause -> push -> flush -> continue; returns the versions the engines report (rank
        0). Other ranks send their own CUDA IPC handles in a per-rank layout
        (`_push_layout`), else only join a collective export (once per push, as rank 0's
        sender); they return []."""
        from engines.weights.sender import build_weight_sender

        layout = self._push_layout(engine_urls)
        if self.rank != 0 and not layout.per_rank:
            if self._joins_export():
                self.backend.export_weights()
            return []
        start = time.perf_counter()
        if self._sender is None or self._sender_urls != engine_urls:
            self.close_weight_sender()
            self._sender = build_weight_sender(self.cfg.train, engine_urls, layout)
            self._sender.connect()
            self._sender_urls = list(engine_urls)
        versions = list(self._sender.update(self.backend, self.version()))
        self._push_timings = {**self._sender.timings, "total_s": time.perf_counter() - start}
        return versions

    def _push_layout(self, engine_urls: list[str]) -> PushLayout:
        """The engines' TP size, and whether every rank sends its own entries: colocated
        tensor sync with one rank per engine GPU, where the placement group gives trainer
        rank r and engine r // TP's TP rank r % TP one bundle (engines/cluster/placement.py)."""
        from engines.weights.sender import PushLayout

        cluster = self.cfg.cluster
        return PushLayout.of(cluster.colocate and self.cfg.train.weight_sync == "tensor",
                             self.world_size, len(engine_urls), cluster.rollout_num_gpus_per_engine)

    def push_timings(self) -> dict[str, float]:
        """Where the last `push_weights` spent its seconds (the sender's `timings`: group
        set-up, pause, export, broadcast, the engines' apply, flush; `total_s`)."""
        return dict(self._push_timings)

    def sends_cuda_ipc(self) -> bool:
        """Colocated on a GPU, `tensor` sync hands the engines CUDA IPC handles over HTTP
        (SGLang's format, nothing copied through the CPU) instead of a CPU copy through
        Ray's object store. (torch, which the device check imports, only where that could
        be so: a mock run's trainer never imports it, test_sglang_server.py.)"""
        if not (self.cfg.cluster.colocate and self.cfg.train.weight_sync == "tensor"):
            return False
        from engines.train.device import resolve_device

        return resolve_device(self.cfg.train.device).type == "cuda"

    def close_weight_sender(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._sender, self._sender_urls = None, []

    def offload(self) -> None:
        """Colocated runs: free the trainer's device memory while the engines generate."""
        self.backend.offload()
        self._phases.append("offload")

    def onload(self) -> None:
        self.backend.onload()
        self._phases.append("onload")

    def phases(self) -> list[str]:
        """What this actor did, in order: `offload`, `onload`, `train {rollout_id}` (replays
        included), the evidence that a colocated trainer gave its memory up between steps."""
        return list(self._phases)

    def weights(self) -> dict[str, Any]:
        """State dict for the engines; returned through Ray's object store. In a group whose
        export is a collective every rank joins it and only rank 0 returns the result."""
        state = self.backend.state_dict_for_engine()
        return {} if self._joins_export() else dict(state)

    def save_checkpoint(self, rollout_id: int) -> str:
        """Checkpoint of the weights after step `rollout_id`; LATEST is moved last."""
        parts = self.layout.checkpoint_parts(rollout_id)
        # every rank saves (a backend may save collectively) into one path, stored per disk
        uri = save_and_store(self.backend.save_checkpoint, self.layout.store, parts,
                             self.cfg.train.checkpoint_staging_dir,
                             prepare=lambda: self.layout.prepare_checkpoint(rollout_id))
        if self.rank != 0:
            return ""
        self.layout.set_latest_checkpoint(rollout_id)
        return uri

    def _load_checkpoint(self, rollout_id: int) -> None:
        parts = self.layout.checkpoint_parts(rollout_id)
        fetch_and_load(self.backend.load_checkpoint, self.layout.store, parts,
                       self.cfg.train.checkpoint_staging_dir)

    def train_step(self, rollout_id: int) -> dict[str, float]:
        """The train stage of step `rollout_id`, idempotent by weight version: trains only if
        the policy is not already past this step, after restoring the version before it.
        Past it (a retried task, or a driver that died before recording the step), it
        returns the metrics of the training it did, which the step records."""
        self.ensure_version(rollout_id)
        if self.version() == rollout_id + 1:
            done = self._last_trained == rollout_id and self._last_metrics
            return dict(self._last_metrics) if done else {"skipped": 1.0}
        return self.train(rollout_id)

    def ensure_version(self, target: int) -> dict[str, Any]:
        """Bring the policy to weight version `target` (the weights step `target` trains).

        Version `target + 1` is also fine when this actor itself just trained step `target`.
        Anything else means this actor's state does not belong to the run on storage (it was
        restarted, or never saw these steps): rebuild from checkpoint + replay of the saved
        train batches, which reproduces the same weights.
        """
        v = self.version()
        if v == target or (v == target + 1 and self._last_trained == target):
            return {"rebuilt": False, "version": v, "replayed": []}
        self.backend = TRAIN_BACKENDS[self.cfg.train.backend](self.cfg)
        latest = self.layout.latest_checkpoint(before=target)
        first = 0
        if latest is not None:
            self._load_checkpoint(latest)
            first = latest + 1
        replay = self._replay(range(first, target), from_checkpoint=latest is not None)
        self.replayed_steps.extend(replay["replayed"])
        return {"rebuilt": True, "version": self.version(), **replay}

    def _replay(self, steps: range, from_checkpoint: bool) -> dict[str, Any]:
        """Train `steps` again, each under the settings it was trained under (its train
        record names them), then go back to the current ones. Returns the steps replayed,
        those without recorded settings (replayed under the current ones), and each recorded
        setting this backend could not honour (`step k: key: recorded -> kept`)."""
        current = StepSettings.of(self.cfg)
        fixed = getattr(self.backend, "fixed_at_build", FIXED_AT_BUILD)
        if from_checkpoint:  # which restored the random state the seed would have set
            fixed = fixed - {"seed"}
        unrecorded: list[int] = []
        inexact: list[str] = []
        stored: dict[str, StepSettings] = {}  # by digest: steps share a few settings at most
        in_use = current_digest = current.digest()
        for k in steps:
            digest = self.layout.train_settings_digest(k)
            settings = current
            if digest is None:
                unrecorded.append(k)
            else:
                if digest not in stored:
                    stored[digest] = StepSettings.from_json(self.layout.train_settings(digest, k))
                settings, lost = settings_for_replay(stored[digest], current, fixed)
                inexact += [f"step {k}: {line}" for line in lost]
            if settings.digest() != in_use:
                self.backend.use_settings(settings)
                in_use = settings.digest()
            self.train(k)
        if in_use != current_digest:
            self.backend.use_settings(current)
        return {"replayed": list(steps), "unrecorded": unrecorded, "inexact": inexact}
