"""`engine.standby_engines`: an engine started beside the pool takes a lost engine's place
without a new process or a model load, the rollout is handed its URL, and a new standby
starts under the lost engine's freed name (with placement: in its freed bundle). Mock engines
on the session's Ray head; the time a replacement takes is bench/engine_replace.py's
(bench/RESULTS.md, "Engine replacement")."""

from __future__ import annotations

import os
import signal
import urllib.request

import pytest
import ray

from engines.cluster.actors import get_or_create_actors, kill_run_actors, run_placement
from engines.cluster.engine_pool import EnginePool
from engines.cluster.head import connect
from storage.config import ConfigError


def _answers(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/health", timeout=10) as reply:
        return reply.status == 200


def test_a_standby_takes_a_lost_engines_place_and_a_new_one_starts(make_config):
    cfg = make_config("standby", "engine.num_engines=2", "engine.standby_engines=1")
    connect(cfg.cluster)
    try:
        actors = get_or_create_actors(cfg)
        assert len(actors.engines) == 2 and len(actors.standby) == 1
        assert (actors.slots, actors.standby_slots) == ([0, 1], [2])
        standby = actors.standby[0]
        standby_url = ray.get(standby.url.remote())
        assert standby_url not in actors.urls  # the rollout is never sent to it
        assert ray.get(actors.rollout.__ray_call__.remote(lambda r: r.engine_urls)) == actors.urls

        lost_url = actors.urls[1]
        os.kill(int(ray.get(actors.engines[1].pid.remote())), signal.SIGKILL)
        pool = EnginePool(cfg, actors)
        pool.replace_lost([lost_url])
        after = pool.actors
        assert after.engines[1] == standby and after.urls == [actors.urls[0], standby_url]
        assert after.slots == [0, 2] and after.standby_slots == [1]
        assert ray.get(after.rollout.__ray_call__.remote(lambda r: r.engine_urls)) == after.urls
        assert _answers(standby_url) and pool.versions() == [0, 0]
        # the new standby: a new process under the freed name engine-1, serving nothing yet
        fresh_url = ray.get(after.standby[0].url.remote())
        assert fresh_url not in after.urls and fresh_url != lost_url and _answers(fresh_url)
    finally:
        kill_run_actors(cfg)


def test_with_placement_a_standby_holds_a_bundle_and_the_new_one_takes_the_freed_bundle(
    make_config,
):
    from engines.cluster.placement import actor_bundle

    def config(rollout_bundles: int):
        return make_config("standby-pg", "cluster.placement=always", "engine.standby_engines=1",
                           f"cluster.rollout_num_gpus={rollout_bundles}")

    short = config(1)  # one engine bundle (a CPU one here): none left for the pool
    connect(short.cluster)
    try:
        with pytest.raises(ConfigError, match="standby_engines=1 leaves no engine bundle"):
            get_or_create_actors(short)
    finally:
        kill_run_actors(short)
    cfg = config(2)  # engine 0 and the standby, a bundle each
    try:
        actors = get_or_create_actors(cfg)
        placement = run_placement(cfg)
        assert placement is not None
        group = placement.pg.id.hex()
        first, second = (placement.engine_bundles(i)[0] for i in (0, 1))
        assert actor_bundle(actors.engines[0]) == (group, first)
        assert actor_bundle(actors.standby[0]) == (group, second)
        os.kill(int(ray.get(actors.engines[0].pid.remote())), signal.SIGKILL)
        pool = EnginePool(cfg, actors)
        pool.replace_lost([actors.urls[0]])
        after = pool.actors
        assert after.engines[0] == actors.standby[0]
        ray.get(after.standby[0].url.remote())
        assert actor_bundle(after.standby[0]) == (group, first)  # the bundle the lost one freed
    finally:
        kill_run_actors(cfg)
