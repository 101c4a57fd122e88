"""Engines join and leave a running training (`rollflow engines add|remove RUN`).

A run starts with one engine; while it trains, `engines add` asks for a second and, once a
step generated on two, `engines remove` for one again. A request takes effect at the next
weight push (the end of each step here: after its train record, before its commit), so a
step runs on the pool asked for before the previous step trained, and not on one asked for
after it committed; with two engines both served requests. The run trains exactly the
samples of an uninterrupted one-engine run (the mock engine's tokens depend on the weight
version too, so an engine that joined with other weights would show), the removed engine's
process is gone, and the run holds one engine and its placement group (bundles for two on
CPUs: `cluster.placement=always`), released with the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import ray

from engines.cluster.actors import kill_run_actors
from engines.cluster.registry import get_run_actor, run_actors
from flows.cli import main
from storage.batch_io import read_samples
from storage.engine_pool import read_pool_request
from storage.run_layout import RunLayout

STEPS = 6
POOL = (f"rollout.num_rollout={STEPS}", "rollout.use_router=false",
        "rollout.max_request_samples=1",  # a request per group: both engines get some
        "cluster.placement=always", "cluster.rollout_num_gpus=2",  # bundles for two engines
        "cluster.keep_actors=true")  # the pool is inspected after the run


def trained(cfg: Any) -> list[tuple[Any, ...]]:
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    return [(k, s.index, s.tokens, s.loss_mask, s.reward, s.weight_version)
            for k in layout.committed_steps()
            for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow")]


Change = tuple[Callable[[RunLayout], bool], Callable[[], None]]


def run_with_changes(cfg: Any, changes: list[Change]) -> None:
    """The train flow in a thread; each change fires once its condition holds, in order."""
    from flows.train import train

    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            train(cfg)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    todo = list(changes)
    while thread.is_alive():
        if todo and todo[0][0](layout):
            todo.pop(0)[1]()
        time.sleep(0.01)
    thread.join()
    if errors:
        raise errors[0]
    assert not todo, f"{len(todo)} pool change(s) never fired"


def generate_records(layout: RunLayout) -> dict[int, dict[str, Any]]:
    return {k: r for k in range(STEPS) if (r := layout.task_record(k, "generate")) is not None}


def test_engines_join_and_leave_a_running_training(prefect_api: str, make_config: Any) -> None:
    from flows.train import train

    ref = make_config("elastic-ref", *POOL)
    try:
        train(ref)
    finally:
        kill_run_actors(ref)
    cfg = make_config("elastic", *POOL)
    root, run, ns = cfg.storage.uri, cfg.storage.run_name, cfg.cluster.namespace
    asked: dict[str, float] = {}
    removed: dict[str, int] = {}

    def engines(action: str) -> Callable[[], None]:
        def fire() -> None:
            if action == "remove":
                removed["pid"] = ray.get(get_run_actor(ns, run, "engine-1").pid.remote())
            assert main(["engines", action, run, "--root", root]) == 0
            request = read_pool_request(RunLayout.open(root, run).store)
            assert request is not None
            asked[action] = request.requested_at
        return fire

    def on_two(layout: RunLayout) -> bool:
        return any(r.get("rollout/engines") == 2.0 for r in generate_records(layout).values())

    try:
        run_with_changes(cfg, [(lambda layout: bool(generate_records(layout)), engines("add")),
                               (on_two, engines("remove"))])
        layout = RunLayout.open(root, run)
        assert layout.committed_steps() == list(range(STEPS))
        pools = {k: int(r["rollout/engines"]) for k, r in generate_records(layout).items()}
        for k in range(1, STEPS):  # step k's pool is set at step k-1's push
            trained_at = layout.task_record(k - 1, "train")
            assert trained_at is not None
            after_train = trained_at["started_at"] + trained_at["seconds"]
            committed = layout.store.read_json(f"steps/{k - 1:06d}", "COMMITTED")["committed_at"]
            if all(not after_train <= t <= committed for t in asked.values()):
                assert pools[k] == 1 + sum((t < after_train) * (1 if a == "add" else -1)
                                           for a, t in asked.items()), (k, pools)
            if pools[k] == 2:  # each engine answered part of the step's requests
                assert generate_records(layout)[k]["rollout/engine_requests_min"] > 0, k
        pools_seen = [pools[k] for k in range(STEPS)]
        assert pools_seen[0] == 1 and 2 in pools_seen and pools_seen[-1] == 1, pools_seen

        assert trained(cfg) == trained(ref)  # the engine count changes no sample

        left = [a.role for a in run_actors(ns, run) if a.role.startswith("engine")]
        assert left == ["engine-0"]
        with pytest.raises(ValueError):
            get_run_actor(ns, run, "engine-1")
        deadline = time.monotonic() + 30
        while psutil.pid_exists(removed["pid"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not psutil.pid_exists(removed["pid"])  # drained, then killed: no process left
        assert ray.get(get_run_actor(ns, run, "engine-0").weight_version.remote()) == STEPS
    finally:
        kill_run_actors(cfg)
    groups = [g for g in ray.util.placement_group_table().values()
              if run in (g.get("name") or "") and g["state"] != "REMOVED"]
    assert groups == []  # (`kill_run_actors` releases the run's placement group)
