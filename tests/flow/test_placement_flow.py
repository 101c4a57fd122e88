"""Placement wired into actor creation, on the CPU-only test head (4 CPUs, `{CPU: 1}`
bundles): two mock steps with a two-rank train group and one engine, each actor pinned to
its bundle, the run's placement group reused by every attach and released with the actors.

An attach must not probe the bundles again: a probe asking for 0.01 CPU waits forever in a
bundle whose CPU an actor already holds.
"""

from __future__ import annotations

import time

import pytest
import ray

from engines.cluster.actors import get_or_create_actors, kill_run_actors, run_placement
from engines.cluster.placement import actor_bundle, create_placement
from engines.cluster.registry import actor_name, get_run_actor
from flows.config.run import ClusterConfig
from storage.config import ConfigError
from storage.run_layout import RunLayout


def test_two_steps_with_actors_pinned_to_the_runs_bundles(prefect_api, make_config):
    from ray.util import get_placement_group

    from flows.train import train

    cfg = make_config("pin", "cluster.placement=always", "cluster.keep_actors=true",
                      "cluster.actor_num_gpus_per_node=2")
    start = time.perf_counter()
    placement = run_placement(cfg)
    placement_s = time.perf_counter() - start
    assert placement is not None
    try:
        result = train(cfg)
        assert RunLayout.open(cfg.storage.uri, cfg.storage.run_name).committed_steps() == [0, 1]
        assert result["resumed_at"] == 0
        pg_id = placement.pg.id.hex()
        assert placement.pg.bundle_specs == [{"CPU": 1.0}] * 3
        run = cfg.storage.run_name
        where = {
            role: actor_bundle(get_run_actor("rollflow-tests", run, role))
            for role in ("trainer-rank0", "trainer-rank1", "engine-0", "rollout")
        }
        assert where == {
            "trainer-rank0": (pg_id, placement.train_bundles[0]),
            "trainer-rank1": (pg_id, placement.train_bundles[1]),
            "engine-0": (pg_id, placement.engine_bundles(0)[0]),
            "rollout": None,  # CPU-light coordinator: outside the bundles
        }
        # a rerun attaches to the same group and actors, without probing the bundles
        start = time.perf_counter()
        actors = get_or_create_actors(cfg)
        reattach_s = time.perf_counter() - start
        assert ray.get(actors.trainer.version.remote()) == 2
        assert get_placement_group(actor_name(cfg, "placement")).id.hex() == pg_id
    finally:
        assert kill_run_actors(cfg) == 4  # rollout, 2 ranks, engine-0
    with pytest.raises(ValueError):
        get_placement_group(actor_name(cfg, "placement"))
    print(f"placement group {placement_s:.2f}s, reattach {reattach_s:.2f}s")


def test_a_group_that_cannot_be_placed_fails_with_the_missing_resources(ray_address):
    """On a cluster given by address (it may grow: an autoscaler), rollflow waits, then
    fails naming what is free of what."""
    from ray.util import get_placement_group

    cfg = ClusterConfig(address=ray_address, actor_num_gpus_per_node=63)
    with pytest.raises(RuntimeError, match=r"CPU: needs 64, free [\d.]+ of 4"):
        create_placement(cfg, name="too-big", timeout_s=2)
    with pytest.raises(ValueError):  # the request was withdrawn, not left pending
        get_placement_group("too-big")


def test_a_group_larger_than_the_local_head_fails_at_once(ray_address):
    """The local head (no cluster.address) never grows: a run needing more than it has in
    all (a one-GPU machine with an engine GPU and a trainer GPU) fails without the wait,
    with what to change."""
    from ray.util import get_placement_group

    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"CPU: needs 64, has 4\. On one machine: "
                                          r"cluster\.colocate=true"):
        create_placement(ClusterConfig(actor_num_gpus_per_node=63), name="too-big-local",
                         timeout_s=60)
    assert time.perf_counter() - start < 10
    with pytest.raises(ValueError):  # nothing was requested
        get_placement_group("too-big-local")


def test_cluster_status_lists_actors_and_bundles_without_a_dashboard(prefect_api, make_config):
    from engines.cluster.head import status

    cfg = make_config("pin", "cluster.placement=always")
    placement = run_placement(cfg)
    assert placement is not None
    try:
        get_or_create_actors(cfg)
        out = status(cfg.cluster)
        mine = {a["name"]: a for a in out["actors"] if a["name"].startswith(cfg.storage.run_name)}
        trainer = mine[actor_name(cfg, "trainer")]
        assert trainer["state"] == "ALIVE" and trainer["bundle"] == placement.train_bundles[0]
        assert any(g["id"] == placement.pg.id.hex() for g in out["placement_groups"])
    finally:
        kill_run_actors(cfg)
