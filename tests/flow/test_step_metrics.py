"""A step re-run by the train flow from its stored records (as after a crash just before
COMMITTED) commits the metrics it committed the first time. The keys of metrics.json and
the records' stored form: tests/unit/test_step_metrics.py."""

from __future__ import annotations

import json

from storage.run_layout import RunLayout


def test_a_step_rerun_from_its_stored_records_commits_the_same_metrics(prefect_api, make_config):
    from engines.cluster.actors import kill_run_actors
    from flows.train import train

    cfg = make_config("metrics", "cluster.keep_actors=true")
    try:
        train(cfg)
        layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
        last = layout.step_metrics(1)

        # Step 1 again from its stored records (as after a crash just before COMMITTED).
        layout.store.delete("steps/000001", "COMMITTED")
        layout.store.delete("steps/000001", "metrics.json")
        assert train(cfg)["resumed_at"] == 1
        again = layout.step_metrics(1)
        rerun_only = {"time/commit", "time/broadcast_weights", "broadcast_weights/seconds",
                      "broadcast_weights/engines_updated"}  # the push always runs again

        def same(m: dict) -> str:
            return json.dumps({k: v for k, v in m.items() if k not in rerun_only}, sort_keys=True)

        assert same(again) == same(last)
        assert again["broadcast_weights/engines_updated"] == 0  # the engines were up to date
    finally:
        kill_run_actors(cfg)
