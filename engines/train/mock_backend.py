"""A train backend without a model, for flow tests.

It keeps the real contract that flows depend on -- the weight version, idempotent
`train(samples, rollout_id)`, checkpoints that restore the version -- and records which
sample indices it trained on, so a test can assert that a resumed or retried run trained every
sample exactly once. Its metrics are deterministic functions of the batch, so two runs of the
same flow produce identical `metrics.json` files.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import TYPE_CHECKING

from engines.config.algorithm import AlgorithmConfig
from engines.config.train import TrainConfig
from engines.train.metrics import SKIPPED, TrainMetrics
from engines.train.step_settings import FIXED_AT_BUILD, StepSettings
from storage.sample import Sample

if TYPE_CHECKING:
    from torch import Tensor

META_FILE = "meta.json"


class MockTrainBackend:
    """Same constructor and public API as `TorchTrainBackend`; no model, no optimizer.

    `fail_at_rollout` makes the first `train()` of that rollout raise, to exercise retries.
    """

    fixed_at_build: frozenset[str] = FIXED_AT_BUILD

    def __init__(
        self,
        train_cfg: TrainConfig | None = None,
        algo_cfg: AlgorithmConfig | None = None,
        rollout_temperature: float = 1.0,
        num_threads: int | None = None,
        reward_key: str | None = None,
        fail_at_rollout: int | None = None,
    ) -> None:
        self.train_cfg = train_cfg
        self.algo_cfg = algo_cfg
        self.rollout_temperature = rollout_temperature
        self.reward_key = reward_key
        self.version = 0
        self._fail_at = fail_at_rollout
        self._trained: dict[int, list[int]] = {}
        self.settings_used: list[StepSettings] = []

    def use_settings(self, settings: StepSettings) -> None:
        """Record the settings the next steps train under (`settings_used` shows them)."""
        self.train_cfg, self.algo_cfg = settings.train, settings.algorithm
        self.rollout_temperature, self.reward_key = settings.temperature, settings.reward_key
        self.settings_used.append(settings)

    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """A fixed value per token that changes with the version (so stale ones are visible)."""
        value = -1.0 / (self.version + 1)
        return [[value] * s.response_length for s in samples]

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        if self.version > rollout_id:
            return dict(SKIPPED)
        if self._fail_at == rollout_id:
            self._fail_at = None
            raise RuntimeError(f"mock train backend: injected failure at rollout {rollout_id}")
        indices = sorted(s.index for s in samples)
        self._trained[rollout_id] = indices
        self.version = rollout_id + 1
        metrics = _mock_metrics(samples, self.reward_key, self.version).to_dict()
        return {**metrics, "index_checksum": index_checksum(indices)}

    def offload(self) -> None:
        """Nothing to move: the mock holds no device memory (colocated flow tests)."""

    def onload(self) -> None:
        """See `offload`."""

    def trained_indices(self) -> list[int]:
        """Every sample index trained so far, in training order (sorted within a step)."""
        return [i for rid in sorted(self._trained) for i in self._trained[rid]]

    def trained_by_rollout(self) -> dict[int, list[int]]:
        return {rid: list(idx) for rid, idx in sorted(self._trained.items())}

    def state_dict_for_engine(self) -> dict[str, Tensor]:
        """Nothing: the mock has no weights, as the mock engine has none (its checksum is the
        empty state's). A push still moves the engines' weight version, which travels beside
        the state dict. So a mock run's actors never import torch: about 1.3 CPU-s each on a
        2-core machine, a fifth of a mock run (bench/RESULTS.md, "CI cost")."""
        return {}

    def save_checkpoint(self, local_dir: str) -> None:
        os.makedirs(local_dir, exist_ok=True)
        meta = {
            "version": self.version,
            "backend": "mock",
            "trained": {str(k): v for k, v in self._trained.items()},
        }
        with open(os.path.join(local_dir, META_FILE), "w") as f:
            json.dump(meta, f)

    def load_checkpoint(self, local_dir: str) -> None:
        with open(os.path.join(local_dir, META_FILE)) as f:
            meta = json.load(f)
        self.version = int(meta["version"])
        self._trained = {int(k): list(v) for k, v in meta["trained"].items()}


def index_checksum(indices: list[int]) -> float:
    """CRC32 of the sorted indices: equal iff the same set of samples was trained."""
    return float(zlib.crc32(json.dumps(sorted(indices)).encode()))


def _mock_metrics(samples: list[Sample], reward_key: str | None, version: int) -> TrainMetrics:
    rewards = [s.scalar_reward(reward_key) for s in samples if s.reward is not None]
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5 if rewards else 0.0
    n = len(samples)
    return TrainMetrics(
        loss=-mean,
        pg_loss=-mean,
        kl_loss=0.0,
        entropy=0.0,
        clipfrac=0.0,
        approx_kl=0.0,
        grad_norm=0.0,
        reward_mean=mean,
        reward_std=std,
        response_len_mean=sum(s.response_length for s in samples) / n if n else 0.0,
        adv_mean=0.0,
        num_samples=float(n),
        num_optimizer_steps=1.0,
        train_tokens_per_s=0.0,
        weight_version=float(version),
    )
