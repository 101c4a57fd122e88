"""Metric sinks: nothing configured gives a null sink; TensorBoard event files and an offline
wandb run hold the logged step metrics."""

from __future__ import annotations

from flows.bookkeeping.metric_sinks import NullSink, open_sinks, scalars
from flows.config.run import LoggingConfig
from storage.run_layout import RunLayout

STEPS = [{"rollout_id": 0, "train/loss": 0.5, "reward/mean": 0.25, "checkpoint": "s3://x"},
         {"rollout_id": 1, "train/loss": 0.25, "reward/mean": 0.75, "skipped": True}]


def test_scalars_keep_numbers_only():
    assert scalars(STEPS[1]) == {"rollout_id": 1.0, "train/loss": 0.25, "reward/mean": 0.75}


def test_no_sinks_is_a_null_object(tmp_path):
    sink = open_sinks(LoggingConfig(), RunLayout.open(str(tmp_path), "r"), "r")
    assert isinstance(sink, NullSink)
    sink.log(STEPS[0], step=0)
    sink.close()
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_events_beside_the_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    layout = RunLayout.open(str(tmp_path), "run-a")
    sink = open_sinks(LoggingConfig(sinks=["tensorboard"]), layout, "run-a")
    for k, metrics in enumerate(STEPS):
        sink.log(metrics, step=k)
    sink.close()
    events = EventAccumulator(str(tmp_path / "run-a" / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["reward/mean", "train/loss"]
    loss = events.Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(0, 0.5), (1, 0.25)]


