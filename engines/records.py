"""Typed records of a rollout step's stages: what the rollout actor's stage methods and the
engine pool (engines/cluster/engine_pool.py) return, what the step tasks store as
`steps/{k}/tasks/{stage}.json`, and which fields become metrics.

```
 RolloutManager.sample_prompts(k)          -> SamplePromptsRecord ─┐ the task times it, stores
 RolloutManager.generate(k)                -> GenerateRecord      ─┤ to_json() as tasks/{stage}
 RolloutManager.filter(k)                  -> FilterRecord        ─┤ .json and on a rerun reads
 RolloutManager.reward(k, kept_groups)     -> RewardRecord        ─┤ it back with from_json()
 TrainActor.train_step(k) -> dict, wrapped -> TrainRecord         ─┤ (tasks/records.py)
 EnginePool.push_after_step(k)             -> BroadcastRecord     ─┘
                commit: StepMetrics(every record's to_metrics()) -> metrics.json
```
The stored JSON is flat and keeps the key names these records had when they were plain
dicts, so a run started before they were typed resumes unchanged and metrics.json keeps its
keys. `to_metrics()` lists the step metrics of a record explicitly: nothing is inferred from
the shape of a key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Self

TIMING_KEYS = ("seconds", "started_at", "finished_at")
"""Keys the step task adds to a stored record (run_once); never part of a stage's own fields."""

Metrics = dict[str, float | int]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageRecord:
    """What every stage's record carries besides its own fields: how long its task took and
    when (set by the task, absent from what an actor returns), and whether the step found the
    record on storage instead of running the stage (never stored)."""

    STAGE: ClassVar[str] = ""
    """The task's name: the record file `tasks/{STAGE}.json` and the metrics' namespace."""

    seconds: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    from_storage: bool = False

    def timed(self, seconds: float, started_at: float, finished_at: float) -> Self:
        return replace(self, seconds=seconds, started_at=started_at, finished_at=finished_at)

    def stored(self) -> Self:
        """This record as read back from storage by a rerun of its step."""
        return replace(self, from_storage=True)

    def timing_json(self) -> dict[str, Any]:
        """The timing keys of a stored record (none on a record no task has timed yet)."""
        if self.started_at is None:
            return {}
        return {"seconds": self.seconds, "started_at": self.started_at,
                "finished_at": self.finished_at}

    def timing_metrics(self) -> Metrics:
        """`time/{stage}` (the curve) and `{stage}/seconds` (the same value, kept because
        metrics.json has always had it)."""
        return {f"{self.STAGE}/seconds": self.seconds, f"time/{self.STAGE}": self.seconds}

    def to_json(self) -> dict[str, Any]:
        """The flat dict stored as `tasks/{STAGE}.json`: the stage's keys, then the timing."""
        raise NotImplementedError

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """A stored record, written by to_json or (the same keys) before records were typed."""
        raise NotImplementedError

    def to_metrics(self) -> Metrics:
        """The step metrics this record contributes, by their metrics.json names."""
        raise NotImplementedError


def timing_of(data: Mapping[str, Any]) -> dict[str, Any]:
    """The StageRecord fields of a stored record (`seconds` is 0.0 for an untimed one)."""
    return {"seconds": data.get("seconds", 0.0), "started_at": data.get("started_at"),
            "finished_at": data.get("finished_at")}


def _present(**values: Any) -> dict[str, Any]:
    """Optional fields as stored: absent when unset, a flag as 1 (as the dict records had it)."""
    return {k: (1 if v is True else v) for k, v in values.items() if v is not None and v is not False}


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplePromptsRecord(StageRecord):
    """The groups drawn for a step (buffer first, then the dataset) and saved as prompts.arrow."""

    STAGE: ClassVar[str] = "sample_prompts"

    groups: int
    uri: str | None = None
    """prompts.arrow (None in `rollout.debug_train_only`, which draws nothing)."""
    epoch: int | None = None
    """The data source's epoch after drawing (None in `rollout.debug_train_only`)."""
    debug_train_only: bool = False
    rows_dropped: int | None = None
    """Dataset rows skipped so far, as drawn, for prompts too long for the model (None: none)."""

    def to_json(self) -> dict[str, Any]:
        return {**_present(uri=self.uri), "groups": self.groups,
                **_present(epoch=self.epoch, debug_train_only=self.debug_train_only,
                           rows_dropped=self.rows_dropped),
                **self.timing_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        return cls(groups=data["groups"], uri=data.get("uri"), epoch=data.get("epoch"),
                   debug_train_only=bool(data.get("debug_train_only")),
                   rows_dropped=data.get("rows_dropped"), **timing_of(data))

    def to_metrics(self) -> Metrics:
        own = {"groups": self.groups,
               **_present(epoch=self.epoch, debug_train_only=self.debug_train_only,
                          rows_dropped=self.rows_dropped)}
        return {**{f"sample_prompts/{k}": v for k, v in own.items()}, **self.timing_metrics()}


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRecord(StageRecord):
    """The groups kept for training (rollout.arrow); the rest went back to the buffer. The
    actor also saves it in the data source's state, so a rerun after that commit returns it."""

    STAGE: ClassVar[str] = "generate"

    uri: str
    groups: int
    extra_draws: int | None = None
    """Groups drawn beyond sample_prompts' (dynamic sampling); None in debug_train_only."""
    buffer_groups: int | None = None
    """Groups in the buffer after this step; None in debug_train_only."""
    debug_train_only: bool = False
    rollout_metrics: dict[str, float] = field(default_factory=dict)
    """The generation loop's own metrics, already named `rollout/...` (none for a custom
    rollout function); stored flat beside the other keys."""
    lost_engines: list[str] = field(default_factory=list)
    """Engines found dead or hung while generating (engines/rollout/engine_watch.py): the
    generate task replaces them."""

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "groups": self.groups,
                **_present(extra_draws=self.extra_draws, buffer_groups=self.buffer_groups,
                           debug_train_only=self.debug_train_only),
                **({"lost_engines": self.lost_engines} if self.lost_engines else {}),
                **self.rollout_metrics, **self.timing_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        own = {"uri", "groups", "extra_draws", "buffer_groups", "debug_train_only",
               "from_storage", "lost_engines", *TIMING_KEYS}
        return cls(uri=data["uri"], groups=data["groups"], extra_draws=data.get("extra_draws"),
                   lost_engines=list(data.get("lost_engines", [])),
                   buffer_groups=data.get("buffer_groups"),
                   debug_train_only=bool(data.get("debug_train_only")),
                   rollout_metrics={k: v for k, v in data.items() if k not in own},
                   **timing_of(data))

    def to_metrics(self) -> Metrics:
        own = {"groups": self.groups,
               **_present(extra_draws=self.extra_draws, buffer_groups=self.buffer_groups,
                          debug_train_only=self.debug_train_only)}
        return {**{f"generate/{k}": v for k, v in own.items()}, **self.rollout_metrics,
                **self.timing_metrics()}


@dataclass(frozen=True, slots=True, kw_only=True)
class FilterRecord(StageRecord):
    """Which generated groups are trained on (over-sampling filter, then trimmed)."""

    STAGE: ClassVar[str] = "filter"

    kept_groups: tuple[int, ...]
    """group_index of every kept group, sorted: the reward stage's input."""
    failed: int
    over_sampling_dropped: int

    @property
    def kept(self) -> int:
        return len(self.kept_groups)

    def to_json(self) -> dict[str, Any]:
        return {"kept_groups": list(self.kept_groups), "filter/kept": self.kept,
                "filter/failed": self.failed,
                "filter/over_sampling_dropped": self.over_sampling_dropped,
                **self.timing_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        return cls(kept_groups=tuple(data["kept_groups"]), failed=data["filter/failed"],
                   over_sampling_dropped=data["filter/over_sampling_dropped"],
                   **timing_of(data))

    def to_metrics(self) -> Metrics:
        return {"filter/kept": self.kept, "filter/failed": self.failed,
                "filter/over_sampling_dropped": self.over_sampling_dropped,
                **self.timing_metrics()}


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardRecord(StageRecord):
    """The training batch (train.arrow) with final scalar rewards, and their statistics."""

    STAGE: ClassVar[str] = "reward"

    uri: str
    samples: int
    mean: float
    std: float
    # Samples rollout.sample_filter_path kept out of the loss; None (and no metric) without one.
    removed: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"uri": self.uri, "samples": self.samples, "reward/mean": self.mean,
                "reward/std": self.std, **self._removed(), **self.timing_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        return cls(uri=data["uri"], samples=data["samples"], mean=data["reward/mean"],
                   std=data["reward/std"], removed=data.get("reward/removed_samples"),
                   **timing_of(data))

    def to_metrics(self) -> Metrics:
        return {"reward/samples": self.samples, "reward/mean": self.mean,
                "reward/std": self.std, **self._removed(), **self.timing_metrics()}

    def _removed(self) -> dict[str, int]:
        return {} if self.removed is None else {"reward/removed_samples": self.removed}


@dataclass(frozen=True, slots=True, kw_only=True)
class BroadcastRecord(StageRecord):
    """A weight push to the engines. Never stored (the stage always runs, it is cheap), so
    only its `seconds` is set."""

    STAGE: ClassVar[str] = "broadcast_weights"

    engines_updated: int
    weight_version: int | None = None
    """The engines' version afterwards (None when the schedule pushed nothing this step)."""
    push: Mapping[str, float] = field(default_factory=dict)
    """Where the trainer's push over HTTP spent its seconds (`WeightSender.timings`:
    `connect_s` at the push that set the group up, `export_s`, `broadcast_s`, `engines_s`,
    ...; `total_s`), stored as `broadcast_weights/push/<key>`; empty for other paths."""

    def to_json(self) -> dict[str, Any]:
        version = {} if self.weight_version is None else {"weight_version": self.weight_version}
        push = {"push": dict(self.push)} if self.push else {}
        return {**version, "engines_updated": self.engines_updated, **push,
                "seconds": self.seconds}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        return cls(engines_updated=data["engines_updated"],
                   weight_version=data.get("weight_version"), push=dict(data.get("push", {})),
                   **timing_of(data))

    def to_metrics(self) -> Metrics:
        version = ({} if self.weight_version is None
                   else {"broadcast_weights/weight_version": self.weight_version})
        push = {f"broadcast_weights/push/{k}": float(v) for k, v in self.push.items()}
        return {**version, "broadcast_weights/engines_updated": self.engines_updated, **push,
                **self.timing_metrics()}
