"""train.update_weights_interval: engines keep the last pushed weights between pushes."""

from __future__ import annotations

from storage.batch_io import read_samples
from storage.run_layout import RunLayout


def test_weights_reach_the_engines_every_second_step(prefect_api, make_config):
    """The schedule itself: tests/unit/test_weight_schedule.py and test_step_tasks.py."""
    from flows.train import train

    cfg = make_config("interval", "rollout.num_rollout=4", "train.update_weights_interval=2")
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    versions = [
        {s.weight_version for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow")}
        for k in range(4)
    ]
    assert versions == [{0}, {0}, {2}, {2}]
    updated = [layout.step_metrics(k)["broadcast_weights/engines_updated"] for k in range(4)]
    assert updated == [0, 1, 0, 1]
    # The trainer still trained every step (the mock trainer's version counts them).
    assert [layout.task_record(k, "train")["weight_version"] for k in range(4)] == [1, 2, 3, 4]
