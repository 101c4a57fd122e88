"""What a train backend reports, and the interface every backend (torch, mock) offers.

`train()` hands back a plain `dict[str, float]` because that is what crosses the Ray/Prefect
boundary and lands in `metrics.json`; `TrainMetrics` is the typed record it is built from, so
the set of keys is fixed in one place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

from torch import Tensor

from storage.sample import Sample

SKIPPED: dict[str, float] = {"skipped": 1.0}
"""Returned by `train()` when the policy is already past the rollout (idempotent replays)."""


@dataclass(frozen=True, slots=True)
class TrainMetrics:
    """One `train()` call. Loss-type terms are averaged over its optimizer steps (each step's
    value is the full-step reduction); batch statistics are over the whole rollout batch."""

    loss: float
    pg_loss: float
    kl_loss: float
    entropy: float
    clipfrac: float
    approx_kl: float
    grad_norm: float
    reward_mean: float
    reward_std: float
    response_len_mean: float
    adv_mean: float
    num_samples: float
    num_optimizer_steps: float
    train_tokens_per_s: float
    weight_version: float
    skipped: float = 0.0
    rollout_logprob_abs_diff: float = float("nan")
    """Mean |old log-prob - engine log-prob| over response tokens: ~0 when the engine runs
    the trainer's weights and numerics (slime's train/rollout mismatch metric)."""

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


@runtime_checkable
class TrainBackend(Protocol):
    """The public API shared by `TorchTrainBackend` and `MockTrainBackend`."""

    version: int

    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]: ...

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]: ...

    def state_dict_for_engine(self) -> dict[str, Tensor]: ...

    def save_checkpoint(self, local_dir: str) -> None: ...

    def load_checkpoint(self, local_dir: str) -> None: ...
