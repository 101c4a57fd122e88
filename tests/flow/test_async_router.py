"""Async mode behind the real sglang-router: a router that dies between steps is restarted on
a new port, and the loop follows it with every group it had."""

from __future__ import annotations

import threading
from typing import Any

import httpx

from engines.rollout.rollout_manager import RolloutManager
from storage.batch_io import read_samples
from storage.run_layout import step_dir
from tests.support.configs import arithmetic_config


def test_the_async_loop_follows_a_restarted_router(arithmetic_data, tiny_model_dir, tmp_path,
                                                   mock_engines):
    cfg = arithmetic_config(
        run_name="async-router", runs_root=str(tmp_path / "runs"), data=arithmetic_data,
        model_dir=tiny_model_dir, ray_address="unused", backend="mock",
        overrides=["rollout.mode=async", "rollout.num_rollout=4", "rollout.rollout_batch_size=2",
                   "rollout.n_samples_per_prompt=2", "rollout.max_response_len=8"],
    )
    mgr = RolloutManager(cfg)
    try:
        mgr.set_engines(mock_engines)
        assert mgr.router is not None
        mgr.generate(0)
        first_router = mgr.router.url
        mgr.router._proc.kill()  # type: ignore[union-attr]  # the router dies between steps
        mgr.router._proc.wait()  # type: ignore[union-attr]
        done: list[Any] = []

        def steps_1_and_2() -> None:
            done.append(mgr.generate(1))  # (drawn before the kill: queued in the loop)
            for url in mock_engines:  # step 1's weights pushed: the loop may draw for step 2
                pushed = httpx.post(f"{url}/update_weight_version", json={"new_version": 1})
                pushed.raise_for_status()
            done.append(mgr.generate(2))  # generated after the kill, through the router

        step = threading.Thread(target=steps_1_and_2, daemon=True)
        step.start()
        step.join(timeout=240)  # (the router restarts inside step 1: seconds, more on a busy CI)
        assert len(done) == 2, "a step never got its groups after the router was restarted"
        assert mgr.router.url != first_router and mgr.router.restarts == 1
        assert mgr.producer is not None and mgr.producer.router_url == mgr.router.url
        groups = [s.group_index for k in (0, 1, 2)
                  for s in read_samples(mgr.layout.store, step_dir(k), "rollout.arrow")]
        assert len(groups) == 12 and len(set(groups)) == 6  # whole groups, none twice
    finally:
        mgr.shutdown()
