"""The remote reward model down mid-step: its 503s are retried with backoff (rollout.rm_*)
and the step goes on when it is back, with no task retry and the samples of a run it never
left."""

from __future__ import annotations

import threading
import time

from storage.run_layout import RunLayout
from tests.support.compare import compare_runs
from tests.support.fakes import RewardServer
from tests.support.faults import run_with_fault, task_run_counts

OUTAGE_S = 6.0


def test_remote_reward_model_down_mid_step_is_ridden_out(prefect_api, make_config, fault_matrix):
    from flows.train import train

    server = RewardServer()
    try:
        remote = ["rollout.num_rollout=3", "rollout.rm_type=remote_rm",
                  f"rollout.rm_url={server.url}", "rollout.reward_key=score",
                  "rollout.rm_backoff_s=0.5", "rollout.rm_max_retries=6"]
        reference = make_config("rm-ref", *remote)
        train(reference)
        cfg = make_config("rm-down", *remote)

        def outage() -> None:
            server.down = True
            threading.Timer(OUTAGE_S, lambda: setattr(server, "down", False)).start()

        started = time.monotonic()
        run_with_fault(cfg, lambda lay: lay.task_record(1, "sample_prompts") is not None, outage)
        seconds = time.monotonic() - started
    finally:
        server.close()
    assert server.refused > 0  # the outage hit requests of the step
    assert seconds > OUTAGE_S
    assert RunLayout.open(cfg.storage.uri, cfg.storage.run_name).committed_steps() == [0, 1, 2]
    runs = task_run_counts(cfg, "generate", lambda c: len(c) == 3)
    assert sorted(runs.values()) == [1, 1, 1], runs  # no task retry: the client's backoff held
    same = compare_runs(reference, cfg)
    assert same.identical, same
    fault_matrix.add(f"remote reward model down {OUTAGE_S:.0f} s (503)", "step 1 generate",
                     "requests retried with backoff, step goes on, no task retry",
                     same.identical)
