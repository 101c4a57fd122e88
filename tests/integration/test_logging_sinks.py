"""The wandb sink offline (wandb runs its own service process)."""

from __future__ import annotations

import glob
import os

from flows.bookkeeping.metric_sinks import FanOut, open_sinks
from flows.config.run import LoggingConfig
from storage.run_layout import RunLayout

STEPS = [{"rollout_id": 0, "train/loss": 0.5, "reward/mean": 0.25, "checkpoint": "s3://x"},
         {"rollout_id": 1, "train/loss": 0.25, "reward/mean": 0.75, "skipped": True}]


def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(sinks=["wandb", "tensorboard"], wandb_dir=str(tmp_path / "wb"),
                        tensorboard_dir=str(tmp_path / "tb"))
    sink = open_sinks(cfg, RunLayout.open("s3://bucket/runs", "run-b"), "run-b")
    assert isinstance(sink, FanOut) and len(sink.sinks) == 2
    wandb_sink = sink.sinks[0]
    for k, metrics in enumerate(STEPS):
        sink.log(metrics, step=k)
    assert wandb_sink.run.summary["train/loss"] == 0.25
    assert wandb_sink.run.id == "run-b" and wandb_sink.run.offline
    sink.close()
    runs = glob.glob(str(tmp_path / "wb" / "run-b" / "wandb" / "offline-run-*-run-b"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "run-run-b.wandb"))
    assert glob.glob(str(tmp_path / "tb" / "run-b" / "events.out.tfevents.*"))
