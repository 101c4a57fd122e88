"""Only a Ray actor's process freezes its heap (a real actor on the session's Ray head)."""

from __future__ import annotations

import gc

import ray

from engines.process import freeze_actor_heap


def test_only_a_ray_actors_process_is_frozen(ray_address: str) -> None:
    freeze_actor_heap()  # in this (test) process: not an actor's, so nothing
    assert gc.get_freeze_count() == 0

    @ray.remote(num_cpus=0)
    class Probe:
        def frozen(self) -> int:
            freeze_actor_heap()
            return gc.get_freeze_count()

    probe = Probe.remote()  # type: ignore[attr-defined]
    try:
        assert ray.get(probe.frozen.remote()) > 1000  # the worker's modules, at least
    finally:
        ray.kill(probe)
