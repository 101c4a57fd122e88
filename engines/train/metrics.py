"""What a train backend reports, and the interface every backend (torch, mock) offers.

`train()` hands back a plain `dict[str, float]` because that is what crosses the Ray/Prefect
boundary and lands in `metrics.json`; `TrainMetrics` is the typed record it is built from, so
the set of keys is fixed in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engines.config.algorithm import RolloutCorrectionConfig
from storage.sample import Sample

if TYPE_CHECKING:  # torch is imported where a tensor is made: the mock backend has none, and
    # a mock run's train actor then never pays torch's import (bench/RESULTS.md, "CI cost")
    from torch import Tensor

SKIPPED: dict[str, float] = {"skipped": 1.0}
"""Returned by `train()` when the policy is already past the rollout (idempotent replays)."""


def already_trained(version: int, samples: list[Sample], rollout_id: int) -> bool:
    """Every backend's `train()` guard: True when the policy (at `version`) is past
    `rollout_id`, so the call returns SKIPPED; an empty batch is a caller's bug."""
    if version > rollout_id:
        return True
    if not samples:
        raise ValueError(f"rollout {rollout_id}: train() got no samples")
    return False


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
    skipped_steps: float = 0.0
    """Optimizer steps not taken because the gradient norm was NaN/inf (a count, not a
    mean; the critic's is `critic/skipped_steps`). Loss terms and grad_norm average the
    steps taken."""

    rollout_logprob_abs_diff: float = float("nan")
    """Mean |old log-prob - engine log-prob| over response tokens: ~0 when the engine runs
    the trainer's weights and numerics (slime's train/rollout mismatch metric)."""

    extra: dict[str, float] = field(default_factory=dict)
    """Algorithm-specific step means that exist only when enabled: critic (`critic/...`),
    mismatch with the engine's log-probs (`ois`, `train_rollout_logprob_abs_diff`, and the
    batch's `mismatch/...`, see `mismatch_metrics`), `lr`, `opd_reverse_kl`."""

    def to_dict(self) -> dict[str, float]:
        out = {f.name: float(getattr(self, f.name)) for f in fields(self) if f.name != "extra"}
        out.update({k: float(v) for k, v in self.extra.items()})
        return out


@runtime_checkable
class TrainBackend(Protocol):
    """The public API shared by `TorchTrainBackend` and `MockTrainBackend`."""

    version: int

    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]: ...

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]: ...

    def state_dict_for_engine(self) -> dict[str, Tensor]: ...

    def save_checkpoint(self, local_dir: str) -> None: ...

    def load_checkpoint(self, local_dir: str) -> None: ...


_CORE_STEP_KEYS = ("loss", "pg_loss", "kl_loss", "entropy", "clipfrac", "approx_kl", "grad_norm")
_COUNTED_STEP_KEYS = ("skipped_steps", "critic/skipped_steps")  # summed over steps, not means


def summarise(
    samples: list[Sample],
    rewards: Tensor,
    advantages: list[Tensor],
    old_log_probs: list[Tensor | None] | None,
    steps: list[dict[str, float]],
    tokens_per_s: float,
    version: int,
    correction: RolloutCorrectionConfig | None = None,
) -> TrainMetrics:
    """Step means of the loss terms (keys a step lacks count as absent, not 0), batch
    statistics over all samples; with `correction`, the batch's mismatch metrics."""

    def step_mean(key: str) -> float:
        values = [s[key] for s in steps if key in s]
        return sum(values) / len(values) if values else 0.0

    def step_sum(key: str) -> float:
        return float(sum(s.get(key, 0.0) for s in steps))

    extra_keys = sorted({k for s in steps for k in s} - {*_CORE_STEP_KEYS, "skipped_steps"})
    extra = {k: step_sum(k) if k in _COUNTED_STEP_KEYS else step_mean(k) for k in extra_keys}
    if correction is not None:
        extra.update(mismatch_metrics(samples, old_log_probs, correction))
    per_sample_adv = [float(a.mean()) if a.numel() else 0.0 for a in advantages]
    return TrainMetrics(
        **{k: step_mean(k) for k in _CORE_STEP_KEYS},
        reward_mean=float(rewards.mean()),
        reward_std=float(rewards.std(correction=0)),
        response_len_mean=sum(s.response_length for s in samples) / len(samples),
        adv_mean=sum(per_sample_adv) / len(per_sample_adv),
        num_samples=float(len(samples)),
        num_optimizer_steps=float(len(steps)),
        train_tokens_per_s=tokens_per_s,
        weight_version=float(version),
        skipped_steps=step_sum("skipped_steps"),
        rollout_logprob_abs_diff=rollout_logprob_abs_diff(samples, old_log_probs),
        extra=extra,
    )


def rollout_logprob_abs_diff(
    samples: list[Sample], old_log_probs: list[Tensor | None] | None
) -> float:
    """Token-mean |trainer - engine| log-prob over samples that carry engine log-probs."""
    import torch

    total, count = 0.0, 0
    for s, old in zip(samples, old_log_probs or [], strict=False):
        if old is None or len(s.rollout_log_probs) != s.response_length or not s.response_length:
            continue
        engine = torch.tensor(s.rollout_log_probs, dtype=old.dtype)
        total += float((old.detach().cpu() - engine).abs().sum())
        count += s.response_length
    return total / count if count else float("nan")


def mismatch_metrics(
    samples: list[Sample], old_log_probs: list[Tensor | None] | None,
    correction: RolloutCorrectionConfig,
) -> dict[str, float]:
    """`mismatch/...` over the loss tokens of the samples that carry engine log-probs and
    have old log-probs (`corrections.mismatch_metrics`): computed once on the whole batch,
    since a minimum and a maximum do not sum over micro-batches like the loss terms."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    from engines.algorithms.corrections import mismatch_metrics as batch_mismatch_metrics

    olds, rollouts, masks = [], [], []
    for s, old in zip(samples, old_log_probs or [], strict=False):
        if old is None or not s.response_length or len(s.rollout_log_probs) != s.response_length:
            continue
        olds.append(old.detach().cpu().float())
        rollouts.append(torch.tensor(s.rollout_log_probs, dtype=torch.float32))
        masks.append(torch.tensor(s.loss_mask, dtype=torch.float32))
    if not olds:
        return {}
    values = batch_mismatch_metrics(
        correction, pad_sequence(olds, batch_first=True),
        pad_sequence(rollouts, batch_first=True), pad_sequence(masks, batch_first=True),
    )
    return {f"mismatch/{k}": v for k, v in values.items()}
