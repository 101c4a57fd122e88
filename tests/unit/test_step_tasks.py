"""The step tasks' logic through `task.fn(...)`, and the engine pool's, with the fake actors of
tests/support/fakes.py: no Ray, no Prefect server. Storage and config are real."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from engines.cluster.actors import RunActors
from engines.cluster.engine_pool import EnginePool
from engines.records import (
    BroadcastRecord,
    FilterRecord,
    GenerateRecord,
    RewardRecord,
    SamplePromptsRecord,
    StageRecord,
)
from tasks import step_tasks as t
from tasks.records import StepMetrics, TrainRecord
from tests.support.fakes import (
    FakeEngine,
    FakeRollout,
    FakeTrainer,
    InProcessReplies,
    fake_actors,
    step_context,
)

# Task records as flat dicts with no optional key (a mock run's, URIs shortened): the stored
# format, which every record must read back and write unchanged.
STORED: dict[str, dict[str, Any]] = {
    "sample_prompts": {"epoch": 0, "finished_at": 1795346394.885868, "groups": 4,
                       "seconds": 0.0226, "started_at": 1795346394.8632243,
                       "uri": "/runs/r/steps/000000/prompts.arrow"},
    "generate": {"buffer_groups": 0, "extra_draws": 0, "finished_at": 1795346395.699198,
                 "groups": 4, "rollout/aborted": 0.0, "rollout/groups_kept": 4.0,
                 "rollout/response_len_mean": 4.0, "rollout/tokens_per_s": 248.1,
                 "seconds": 0.7449, "started_at": 1795346394.9543064,
                 "uri": "/runs/r/steps/000000/rollout.arrow"},
    "filter": {"filter/failed": 0, "filter/kept": 4, "filter/over_sampling_dropped": 0,
               "finished_at": 1795346395.7417848, "kept_groups": [0, 1, 2, 3],
               "seconds": 0.0207, "started_at": 1795346395.7210567},
    "reward": {"finished_at": 1795346395.7865582, "reward/mean": 0.25, "reward/std": 0.5,
               "samples": 16, "seconds": 0.024, "started_at": 1795346395.762481,
               "uri": "/runs/r/steps/000000/train.arrow"},
    "train": {"adv_mean": 0.0, "finished_at": 1795346395.8071012, "grad_norm": 0.5,
              "index_checksum": 1694264091.0, "loss": -0.0, "num_samples": 16.0,
              "seconds": 0.0095, "skipped": 0.0, "started_at": 1795346395.7975898,
              "train/seconds": 0.00014, "weight_version": 1.0, "critic/value_loss": 0.1},
}
STORED_DEBUG = {  # rollout.debug_train_only
    "sample_prompts": {"groups": 0, "debug_train_only": 1, "seconds": 0.01, "started_at": 1.0,
                       "finished_at": 1.01},
    "generate": {"uri": "/runs/r/steps/000000/rollout.arrow", "groups": 4,
                 "debug_train_only": 1, "seconds": 0.02, "started_at": 2.0, "finished_at": 2.02},
}
KINDS: dict[str, type[StageRecord]] = {
    "sample_prompts": SamplePromptsRecord, "generate": GenerateRecord, "filter": FilterRecord,
    "reward": RewardRecord, "train": TrainRecord, "broadcast_weights": BroadcastRecord,
}


def metrics_by_key_shape(rollout_id: int, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The step metrics by the shapes of the keys: a key with a `/` as it is, any other
    number under its stage, `time/<stage>` from `seconds`.

    The train record holds the trainer's `train/seconds` and the task's `seconds`; the
    task's wins (`as_fresh` puts the timing last)."""
    metrics: dict[str, Any] = {"rollout_id": rollout_id}
    for name, rec in ((name, as_fresh(rec)) for name, rec in records.items()):
        for key, value in rec.items():
            if key in ("started_at", "finished_at"):
                continue
            if isinstance(value, int | float) and not isinstance(value, bool):
                metrics[key if "/" in key else f"{name}/{key}"] = value
        metrics[f"time/{name}"] = rec.get("seconds", 0.0)
    return metrics


def as_fresh(record: dict[str, Any]) -> dict[str, Any]:
    timing = ("seconds", "started_at", "finished_at")
    return {**{k: v for k, v in record.items() if k not in timing},
            **{k: record[k] for k in timing if k in record}}


@pytest.mark.parametrize("records", [STORED, STORED_DEBUG], ids=["normal", "debug_train_only"])
def test_records_read_stored_dicts_and_keep_their_metrics(records):
    for name, stored in records.items():
        record = KINDS[name].from_json(stored)
        assert name == record.STAGE
        assert record.to_json() == stored  # the file a rerun writes is the one it read
        assert KINDS[name].from_json(record.to_json()) == record
        assert {"rollout_id": 0, **record.to_metrics()} == metrics_by_key_shape(0, {name: stored})


def test_step_metrics_follow_the_key_shape_rule():
    stored = copy.deepcopy(STORED)
    pushed = {"weight_version": 1, "engines_updated": 1, "seconds": 0.16}
    records = [KINDS[name].from_json(rec) for name, rec in stored.items()]
    records.append(BroadcastRecord.from_json(pushed))
    expected = metrics_by_key_shape(0, {**stored, "broadcast_weights": pushed})
    assert StepMetrics(0, records, "ckpt-uri", 0.5).to_json() == {
        **expected, "checkpoint": "ckpt-uri", "time/commit": 0.5}
    # The trainer's own train/seconds gives way to the task's.
    assert expected["train/seconds"] == expected["time/train"] == 0.0095


def test_records_survive_pickling():
    import pickle

    for name, stored in STORED.items():
        record = KINDS[name].from_json(stored).stored()
        assert pickle.loads(pickle.dumps(record)) == record


def test_run_once_reuses_the_stored_record(tmp_path):
    ctx = step_context(tmp_path)
    rollout: FakeRollout = ctx.actors.rollout
    first = t.sample_prompts.fn(ctx, 0)
    assert isinstance(first, SamplePromptsRecord) and not first.from_storage
    assert first.groups == 2 and first.started_at is not None and first.seconds >= 0
    stored = ctx.layout.task_record(0, "sample_prompts")
    assert stored is not None and set(stored) == {
        "uri", "groups", "epoch", "seconds", "started_at", "finished_at"}

    again = t.sample_prompts.fn(ctx, 0)
    assert again.from_storage and again == first.stored()
    assert [c[0] for c in rollout.calls] == ["sample_prompts"]  # not asked twice


def test_a_stored_flat_record_is_reused(tmp_path):
    ctx = step_context(tmp_path)
    for name in ("generate", "filter"):
        ctx.layout.save_task_record(0, name, STORED[name])
    generated = t.generate.fn(ctx, 0)
    filtered = t.filter_groups.fn(ctx, 0)
    assert generated.from_storage and generated.rollout_metrics["rollout/groups_kept"] == 4.0
    assert filtered.from_storage and filtered.kept_groups == (0, 1, 2, 3)
    rewarded = t.reward.fn(ctx, 0, filtered.kept_groups)
    assert not rewarded.from_storage and rewarded.samples == 8
    assert ctx.actors.rollout.calls == [("reward", (0, (0, 1, 2, 3)))]


def test_generate_brings_engines_up_to_date_first(tmp_path):
    ctx = step_context(tmp_path, "engine.num_engines=2",
                       actors=fake_actors(engine_versions=(0, 1), trainer_version=1))
    record = t.generate.fn(ctx, 1)
    assert isinstance(record, GenerateRecord) and record.groups == 2
    assert [e._version for e in ctx.actors.engines] == [1, 1]


def test_train_always_asks_the_trainer_and_keeps_the_first_record(tmp_path):
    ctx = step_context(tmp_path)
    trainer: FakeTrainer = ctx.actors.trainer
    first = t.train_step.fn(ctx, 0)
    assert not first.from_storage and first.metrics["weight_version"] == 1.0
    assert ctx.layout.task_record(0, "train") == first.to_json()
    again = t.train_step.fn(ctx, 0)  # the trainer, already past step 0, skips it
    assert again.from_storage and again.metrics == first.metrics
    assert [c[0] for c in trainer.calls] == ["train_step", "train_step"]


def test_a_whole_step_commits_its_records_metrics(tmp_path):
    ctx = step_context(tmp_path, "train.save_interval=2")
    sampled = t.sample_prompts.fn(ctx, 0)
    generated = t.generate.fn(ctx, 0)
    filtered = t.filter_groups.fn(ctx, 0)
    rewarded = t.reward.fn(ctx, 0, filtered.kept_groups)
    trained = t.train_step.fn(ctx, 0)
    pushed = t.broadcast_weights.fn(ctx, 0)
    records = [sampled, generated, filtered, rewarded, trained, pushed]
    metrics = t.commit.fn(ctx, 0, records)

    assert ctx.layout.is_committed(0)
    assert ctx.layout.step_metrics(0) == metrics
    # The same metrics the key-shape rule made from the dict records.
    as_dicts = {r.STAGE: r.to_json() for r in records}
    assert {k: v for k, v in metrics.items() if k != "time/commit"} == metrics_by_key_shape(0, as_dicts)
    assert set(metrics) == {
        "rollout_id", "time/commit",
        *(f"{stage}/seconds" for stage in KINDS), *(f"time/{stage}" for stage in KINDS),
        "sample_prompts/groups", "sample_prompts/epoch",
        "generate/groups", "generate/extra_draws", "generate/buffer_groups",
        "rollout/groups_kept", "rollout/response_len_mean",
        "filter/kept", "filter/failed", "filter/over_sampling_dropped",
        "reward/samples", "reward/mean", "reward/std",
        "train/loss", "train/grad_norm", "train/skipped", "train/weight_version",
        "critic/value_loss",
        "broadcast_weights/engines_updated", "broadcast_weights/weight_version",
    }
    assert metrics["train/seconds"] == trained.seconds  # the task's time, not the trainer's
    assert "checkpoint" not in metrics  # save_interval=2: step 1 is the first

    step1 = [t.sample_prompts.fn(ctx, 1), t.generate.fn(ctx, 1), t.train_step.fn(ctx, 1)]
    metrics1 = t.commit.fn(ctx, 1, step1)
    assert metrics1["checkpoint"] == "mem://checkpoints/000001"
    assert [c for c in ctx.actors.trainer.calls if c[0] != "train_step"][-2:] == [
        ("ensure_version", (2,)), ("save_checkpoint", (1,))]


@pytest.mark.parametrize(("save_interval", "steps"), [
    (None, [4]), (1, [0, 1, 2, 3, 4]), (2, [1, 3, 4]), (3, [2, 4]), (10, [4]),
])
def test_should_checkpoint_every_interval_and_at_the_last_step(tmp_path, save_interval, steps):
    ctx = step_context(tmp_path, "rollout.num_rollout=5",
                       f"train.save_interval={'null' if save_interval is None else save_interval}")
    assert [k for k in range(5) if t.should_checkpoint(ctx.cfg, k)] == steps


def test_sync_weights_pushes_only_stale_engines(tmp_path):
    pool = step_context(tmp_path, actors=fake_actors(engine_versions=(2, 1, 0),
                                                     trainer_version=2)).pool
    record = pool.sync_weights()
    assert record == BroadcastRecord(weight_version=2, engines_updated=2)
    assert [e._version for e in pool.actors.engines] == [2, 2, 2]
    assert pool.actors.engines[0].calls == [("weight_version", ())]
    assert pool.sync_weights().engines_updated == 0


def test_sync_weights_leaves_fresh_engines_without_asking_the_trainer(tmp_path):
    pool = step_context(tmp_path, actors=fake_actors(engine_versions=(3, 4),
                                                     trainer_version=5)).pool
    record = pool.sync_weights(min_version=3)
    assert record == BroadcastRecord(weight_version=3, engines_updated=0)
    assert pool.actors.trainer.calls == []  # it may be busy training (async mode)
    assert pool.sync_weights(min_version=4).engines_updated == 2


def test_a_replacement_engine_takes_a_survivors_weights_not_the_trainers(tmp_path):
    """update_weights_interval > 1 (or async): the engines hold version 3, the trainer 5.
    The engine that replaced a lost one gets version 3's weights from a survivor; pushing
    the trainer's would have moved every engine to 5, ahead of the run's schedule."""
    pool = step_context(tmp_path, actors=fake_actors(engine_versions=(3, 0, 3),
                                                     trainer_version=5)).pool
    assert pool.match_survivors() == [3, 3, 3]
    assert [e._version for e in pool.actors.engines] == [3, 3, 3]
    new = pool.actors.engines[1]
    assert isinstance(new, FakeEngine) and new.weights_from == {"engine": 0, "version": 3}
    assert pool.actors.trainer.calls == []  # (in async mode it may be busy training)
    assert pool.match_survivors() == [3, 3, 3]  # nothing behind: nothing moves
    blind = step_context(tmp_path / "blind", actors=fake_actors(engine_versions=(3, 0),
                                                                trainer_version=5)).pool
    for engine in blind.actors.engines:
        engine._exports = False  # an engine that cannot hand its weights over
    assert blind.match_survivors() is None  # the caller pushes the trainer's
    assert [e._version for e in blind.actors.engines] == [3, 0]


def test_an_engine_that_does_not_answer_is_replaced_and_takes_a_survivors_weights(
    tmp_path, monkeypatch
):
    """The health check before generate: engine 1 gives no answer within
    rollout.engine_hang_timeout_s, so it is replaced, and its successor gets the surviving
    engine's weights (version 3), not the trainer's (5)."""
    import engines.cluster.engine_pool as engine_pool

    class SecondHangs(InProcessReplies):
        def answered(self, refs, timeout_s):
            return [i != 1 for i in range(len(refs))]

    replaced: list[list[str]] = []

    def replace_lost_engines(cfg, actors, lost_urls):
        replaced.append(lost_urls)
        fresh = FakeEngine(1, version=0)
        return RunActors(rollout=actors.rollout, trainer=actors.trainer,
                         engines=[actors.engines[0], fresh],
                         urls=[actors.urls[0], fresh.address])

    monkeypatch.setattr(engine_pool, "replace_lost_engines", replace_lost_engines)
    ctx = step_context(tmp_path, "engine.num_engines=2")
    pool = EnginePool(ctx.cfg, fake_actors(engine_versions=(3, 3), trainer_version=5),
                      SecondHangs())
    pool.prepare_generation(3)  # (required version 3)
    assert replaced == [["http://127.0.0.1:30001"]]
    assert [e._version for e in pool.actors.engines] == [3, 3]
    assert pool.actors.trainer.calls == []


def test_sync_weights_over_http_hands_the_trainer_every_engine_url(tmp_path):
    pool = step_context(tmp_path, "train.weight_sync=distributed",
                        actors=fake_actors(engine_versions=(1, 0), trainer_version=1)).pool
    record = pool.sync_weights()
    assert record == BroadcastRecord(weight_version=1, engines_updated=1)
    assert [c for c in pool.actors.trainer.calls if c[0] == "push_weights"] == [
        ("push_weights", (["http://127.0.0.1:30000", "http://127.0.0.1:30001"],))]


def test_sync_weights_over_http_keeps_where_the_push_spent_its_seconds(tmp_path):
    pool = step_context(tmp_path, "train.weight_sync=distributed",
                        actors=fake_actors(engine_versions=(0, 0), trainer_version=1)).pool
    timings = {"connect_s": 0.5, "export_s": 0.25, "broadcast_s": 0.125, "total_s": 1.0}
    pool.actors.trainer.timings = dict(timings)
    record = pool.sync_weights()
    assert record.push == timings
    metrics = record.to_metrics()
    assert {k: metrics[f"broadcast_weights/push/{k}"] for k in timings} == timings
    assert BroadcastRecord.from_json(record.to_json()) == record


def test_broadcast_follows_the_weight_push_schedule(tmp_path):
    ctx = step_context(tmp_path, "rollout.num_rollout=4", "train.update_weights_interval=2",
                       actors=fake_actors(trainer_version=1))
    held = t.broadcast_weights.fn(ctx, 0)
    assert held.engines_updated == 0 and held.weight_version is None
    assert set(held.to_metrics()) == {"broadcast_weights/engines_updated",
                                      "broadcast_weights/seconds", "time/broadcast_weights"}
    pushed = t.broadcast_weights.fn(ctx, 1)
    assert (pushed.engines_updated, pushed.weight_version) == (1, 1)


def test_evaluate_reuses_a_saved_evaluation(tmp_path):
    ctx = step_context(tmp_path)
    ctx.layout.save_eval(2, {"eval/arithmetic/accuracy": 0.5})
    assert t.evaluate_version.fn(ctx, 2) == {"eval/arithmetic/accuracy": 0.5}
    assert t.evaluate_version.fn(ctx, 3) == {"eval/arithmetic/accuracy": 0.25}
    assert ctx.actors.rollout.calls == [("evaluate", (3,))]
