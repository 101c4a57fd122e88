"""Replay: train again on the saved `train.arrow` batches of a run, into a new run, with no
engines -- for ablations (a new loss or learning rate on the same data) and for bisecting a
loss spike (the equivalent of slime's load_debug_rollout_data over the whole run history).

```
source run  steps/k/train.arrow ──copy──> replay run  steps/k/train.arrow ──> TrainActor.train(k)
            checkpoints/c/      ──copy──>             checkpoints/c/ + LATEST   (weights at A)
```
Replaying steps A..B-1 needs the weights the source run had before step A: the newest source
checkpoint before A is copied in, and the steps between it and A are trained first (the
trainer's own rebuild path, `ensure_version`), without being reported. Each replayed step
commits like a rollout step (`metrics.json`, then `COMMITTED`), so an interrupted replay
resumes where it stopped. Every source batch is checked (parses; size and sha256 as its step
recorded) before anything is copied, so a corrupt source fails naming its file and leaves
nothing behind in the new run.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import ray
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from engines.cadence import every_n_steps_or_last
from engines.cluster.actors import get_or_create_trainer, kill_run_actors
from engines.cluster.head import connect
from engines.train.step_settings import StepSettings, settings_differences, settings_digest
from flows.bookkeeping.metric_sinks import open_sinks
from flows.bookkeeping.reporting import publish_run_report, publish_step_table
from flows.config.history import warn_if_replayed_under_changed_config
from flows.config.loader import dump_config
from flows.config.run import ConfigError, RollflowConfig
from flows.config.storage_credentials import with_storage_credentials
from flows.rollout_step import open_layout
from storage.batch_io import read_table
from storage.integrity import MANIFEST_FILE
from storage.object_store import ObjectStore
from storage.run_layout import RunLayout, step_dir

log = logging.getLogger(__name__)


def parse_steps(text: str) -> tuple[int, int]:
    """`A:B` -> (A, B), the half-open range of rollout ids; `A` alone means A:A+1."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        raise ConfigError(f"--steps {text!r}: expected A:B with integers") from None
    start, end = (parts[0], parts[0] + 1) if len(parts) == 1 else (parts[0], parts[1])
    if len(parts) > 2 or start < 0 or end <= start:
        raise ConfigError(f"--steps {text!r}: expected A:B with 0 <= A < B")
    return start, end


def replay_config(
    source_text: str, root: str, source_run: str, steps: tuple[int, int],
    overrides: list[str], endpoint_url: str | None = None,
) -> RollflowConfig:
    """The source run's config.yaml, moved to a new run `<source>-replay-<A>-<B>` under
    `root`, then the user's `--set` overrides (which may rename it or change the loss)."""
    import yaml

    from flows.config.loader import apply_overrides, config_from_dict
    from flows.config.run import drop_redacted

    data = yaml.safe_load(source_text) or {}
    storage = data.setdefault("storage", {})
    storage.update(uri=root, run_name=f"{source_run}-replay-{steps[0]}-{steps[1]}")
    storage["storage_options"] = drop_redacted(storage.get("storage_options") or {})
    if endpoint_url:
        storage["endpoint_url"] = endpoint_url
    return config_from_dict(apply_overrides(data, overrides))


@dataclass(frozen=True)
class ReplayPlan:
    source_run: str
    start: int
    end: int
    checkpoint: int | None  # source checkpoint holding the weights before `warmup`
    warmup: list[int]  # steps trained (not reported) to reach the weights before `start`

    @property
    def steps(self) -> list[int]:
        return list(range(self.start, self.end))


def plan_replay(source: RunLayout, source_run: str, start: int, end: int) -> ReplayPlan:
    """Check the source has what the replay needs; pick the checkpoint to start from."""
    committed = set(source.committed_steps())
    checkpoint = source.latest_checkpoint(before=start)  # the newest complete one
    warmup = list(range(0 if checkpoint is None else checkpoint + 1, start))
    missing = [k for k in warmup + list(range(start, end)) if k not in committed]
    if missing:
        raise ConfigError(
            f"run {source_run!r} at {source.uri}: steps {missing} are not committed "
            f"(committed: {sorted(committed) or 'none'})"
        )
    return ReplayPlan(source_run, start, end, checkpoint, warmup)


def check_source(source: RunLayout, plan: ReplayPlan) -> None:
    """Read everything the replay will copy: `CorruptFileError` names the first batch that
    does not parse or differs from what its step's COMMITTED marker recorded, or the first
    checkpoint file that differs from its manifest (one saved without a manifest, before
    they existed, is copied as it is)."""
    for k in plan.warmup + plan.steps:
        read_table(source.store, step_dir(k), "train.arrow")
    c = plan.checkpoint
    if c is not None and source.store.exists(*source.checkpoint_parts(c), MANIFEST_FILE):
        problems = source.checkpoint_problems(c, checksums=True)
        if problems:
            raise problems[0]


def copy_tree(src: ObjectStore, dst: ObjectStore, *parts: str) -> int:
    """Copy every file under `parts` from one store to another; returns the file count."""
    base = src.path(*parts)
    files = [f for f in src.fs.find(base) if not f.endswith("/")]
    for f in files:
        rel = f[len(base):].lstrip("/")
        dst.write_bytes(src.fs.cat_file(f), *parts, rel)
    return len(files)


def copy_train_settings(source: RunLayout, layout: RunLayout, rollout_id: int) -> None:
    """Name the settings a warmup step trained under in the source run, so that it trains
    under them here too and the replay starts from the source's weights at `start`."""
    digest = source.train_settings_digest(rollout_id)
    if digest is not None:
        layout.save_train_settings(source.train_settings(digest, rollout_id), digest)
        record_train_settings(layout, rollout_id, digest)


def record_train_settings(layout: RunLayout, rollout_id: int, digest: str) -> None:
    """What a rollout step's train record says of its settings (`RunLayout.train_settings_of`);
    the settings themselves are stored once (`RunLayout.save_train_settings`)."""
    layout.save_task_record(rollout_id, "train", {"settings": digest})


def warn_of_other_settings(source: RunLayout, plan: ReplayPlan, settings: dict[str, Any]) -> None:
    """Say which replayed steps the source trained under other settings than the replay's
    (its latest config plus `--set`): a run whose config changed is not reproduced unless
    the replay sets those keys back."""
    steps_of: dict[str, list[int]] = {}  # digest -> steps: each stored settings read once
    for k in plan.steps:
        digest = source.train_settings_digest(k)
        if digest is not None:
            steps_of.setdefault(digest, []).append(k)
    changes: dict[str, list[int]] = {}
    for digest, steps in steps_of.items():
        for line in settings_differences(source.train_settings(digest, steps[0]), settings):
            changes.setdefault(line, []).extend(steps)
    if changes:
        log.warning("the source run trained some of the replayed steps under other settings "
                    "than this replay's, which it trains them under: %s",
                    "; ".join(f"{line} (steps {sorted(steps)})" for line, steps in changes.items()))


@task(name="prepare_replay", cache_policy=NO_CACHE)
def prepare_replay(source: RunLayout, layout: RunLayout, plan: ReplayPlan) -> dict[str, Any]:
    """Copy the batches and the starting checkpoint into the new run (idempotent)."""
    copied = 0
    for k in plan.warmup + plan.steps:
        if not layout.store.exists(step_dir(k), "train.arrow"):
            layout.store.write_bytes(source.store.read_bytes(step_dir(k), "train.arrow"),
                                     step_dir(k), "train.arrow")
            copied += 1
    for k in plan.warmup:
        copy_train_settings(source, layout, k)
    if plan.checkpoint is not None and layout.latest_checkpoint() is None:
        copy_tree(source.store, layout.store, *source.checkpoint_parts(plan.checkpoint))
        layout.set_latest_checkpoint(plan.checkpoint)
    return {"batches_copied": copied, "checkpoint": plan.checkpoint}


def step_metrics(rollout_id: int, train_metrics: dict[str, Any]) -> dict[str, Any]:
    """Same keys as a rollout step's metrics.json (`train/loss`, ...), so runs compare."""
    out: dict[str, Any] = {"rollout_id": rollout_id}
    for key, value in train_metrics.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key if "/" in key else f"train/{key}"] = value
    return out


@task(name="replay_train", task_run_name="replay-train-{rollout_id}", cache_policy=NO_CACHE,
      retries=1, retry_delay_seconds=2)
def replay_train(
    layout: RunLayout, trainer: Any, rollout_id: int, checkpoint: bool, digest: str
) -> dict[str, Any]:
    if layout.is_committed(rollout_id):
        return layout.step_metrics(rollout_id)
    ray.get(trainer.ensure_version.remote(rollout_id))  # a retry after a half-done step rebuilds
    metrics = step_metrics(rollout_id, ray.get(trainer.train.remote(rollout_id)))
    record_train_settings(layout, rollout_id, digest)  # (the settings are stored: replay())
    if checkpoint:
        metrics["checkpoint"] = ray.get(trainer.save_checkpoint.remote(rollout_id))
    layout.store.write_json(metrics, step_dir(rollout_id), "metrics.json")
    layout.mark_committed(rollout_id)
    return metrics


@flow(name="replay", flow_run_name="replay-{source_run}-{start}-{end}", persist_result=False)
def replay(config: RollflowConfig, source_run: str, start: int, end: int) -> dict[str, Any]:
    """Train steps start..end-1 of `source_run` (a run under `config.storage.uri`) again,
    into the run `config.storage.run_name`, with the train/algorithm sections of `config`."""
    if source_run == config.storage.run_name:
        raise ConfigError("storage.run_name of a replay must differ from the source run")
    config = with_storage_credentials(config)
    connect(config.cluster)
    layout = open_layout(config)
    s = config.storage
    source = RunLayout.open(s.uri, source_run, s.endpoint_url, s.store_options())
    plan = plan_replay(source, source_run, start, end)
    check_source(source, plan)
    if not layout.store.exists("config.yaml"):
        layout.store.write_text(dump_config(config), "config.yaml")
        layout.store.write_json(asdict(plan), "replay.json")
    prepared = prepare_replay(source, layout, plan)
    trainer = get_or_create_trainer(config)
    todo = [k for k in plan.steps if not layout.is_committed(k)]
    restored = ray.get(trainer.ensure_version.remote(todo[0] if todo else end))
    sinks = open_sinks(config.logging, layout, config.storage.run_name)
    interval = config.train.save_interval
    settings = StepSettings.of(config).to_json()  # what the replayed steps train under
    digest = settings_digest(settings)
    layout.save_train_settings(settings, digest)
    warn_if_replayed_under_changed_config(restored, layout, config)  # (the warmup)
    warn_of_other_settings(source, plan, settings)
    rows = []
    for k in plan.steps:
        save = every_n_steps_or_last(k, interval, end)
        rows.append(replay_train(layout, trainer, k, save, digest))
        sinks.log(rows[-1], step=k)
    sinks.close()
    publish_step_table(rows, key=f"{config.storage.run_name}-replay-metrics")
    report = publish_run_report(layout, make_plot=config.logging.plot)
    if not config.cluster.keep_actors:
        kill_run_actors(config)
    return {"run_dir": layout.uri, "plan": asdict(plan), "prepared": prepared,
            "restored": restored, "losses": [r.get("train/loss") for r in rows], **report}
