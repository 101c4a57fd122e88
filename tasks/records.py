"""Records only the driver builds: the train stage's (wrapping what the trainer reports) and a
step's metrics. The rollout stages' records, which the rollout actor returns, and the weight
push's, which the engine pool returns, are in engines/records.py (with the picture of which
stage makes which)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

from engines.records import TIMING_KEYS, Metrics, StageRecord, timing_of


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainRecord(StageRecord):
    """The train stage: what the trainer's `train_step` reported, as the backend names it
    (`TrainMetrics.to_dict()`: bare names such as `loss`, `weight_version`, plus namespaced
    extras such as `critic/value_loss`; `{"skipped": 1.0}` when the policy was already past
    the step), stored flat beside the timing."""

    STAGE: ClassVar[str] = "train"

    metrics: dict[str, float] = field(default_factory=dict)
    settings: str | None = None
    """The digest of the settings the step trained under (`RunLayout.save_train_settings`):
    what a rebuilt trainer replays the step under."""

    def to_json(self) -> dict[str, Any]:
        named = {} if self.settings is None else {"settings": self.settings}
        return {**self.metrics, **named, **self.timing_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        own = {k: v for k, v in data.items()
               if k not in (*TIMING_KEYS, "from_storage", "settings")}
        return cls(metrics=own, settings=data.get("settings"), **timing_of(data))

    def to_metrics(self) -> Metrics:
        """A bare backend name goes under `train/`, a namespaced one stays as it is. The task's
        `train/seconds` (time/train) replaces the trainer's own of the same name."""
        reported = {(k if "/" in k else f"train/{k}"): v for k, v in self.metrics.items()
                    if isinstance(v, int | float) and not isinstance(v, bool)}
        return {**reported, **self.timing_metrics()}


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """A step's metrics.json: its id, every stage record's `to_metrics()` in stage order, the
    checkpoint written at commit (if any) and the commit's own time."""

    rollout_id: int
    stages: Sequence[StageRecord]
    checkpoint: str | None = None
    commit_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rollout_id": self.rollout_id}
        for record in self.stages:
            out.update(record.to_metrics())
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        out["time/commit"] = self.commit_seconds
        return out
