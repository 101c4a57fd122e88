"""The trainer and engine actors start with the configured torch thread count (real actors
on the session's Ray head)."""

from __future__ import annotations

import pytest
import ray

from engines.inference.engine_actor import EngineActor
from engines.process import machine_cores
from engines.train.train_actor import TrainActor


def _torch_threads(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: __import__("torch").get_num_threads()))


@pytest.mark.parametrize("configured", [None, 1])
def test_trainer_and_engine_actors_get_the_configured_threads(
    configured, make_config
):
    if machine_cores() < 2:
        pytest.skip("one core: all cores and Ray's one thread are the same")
    threads = "null" if configured is None else configured
    cfg = make_config("threads", f"cluster.actor_num_threads={threads}", backend="embedded")
    want = configured or machine_cores()
    trainer = ray.remote(TrainActor).options(num_cpus=0).remote(cfg)
    engine = ray.remote(EngineActor).options(num_cpus=0).remote(
        cfg.engine, 0, cfg.cluster.actor_num_threads)
    try:
        assert _torch_threads(trainer) == want
        # the engine drops to one thread for small decode steps, on its scheduler thread
        # only; what it was given is its generator's ceiling
        assert ray.get(engine.__ray_call__.remote(lambda self: self.generator._threads)) == want
    finally:
        ray.kill(trainer)
        ray.kill(engine)
