"""Named, detached actors of one run: get them if they exist, create them if not.

Flow runs attach to these instead of reloading models, so a run's second step costs no
model load, and a driver that crashed can be re-run against the same warm actors.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from engines.rollout.engine_actor import EngineActor
from engines.rollout.rollout_manager import RolloutManager
from engines.rollout.sglang_launcher import ExternalSGLangEngine, SGLangServerActor
from engines.train.null_trainer import NullTrainActor
from engines.train.train_actor import TrainActor
from flows.config import RollflowConfig


@functools.cache
def code_digest() -> str:
    """Hash of rollflow's own source. Detached actors outlive the driver, so after an upgrade
    (or a `git pull`) a rerun must not attach to actors still running the old code."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    for package in ("flows", "tasks", "engines", "storage"):
        for path in sorted((root / package).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:8]


def actor_name(run_name: str, role: str) -> str:
    return f"{run_name}:{role}@{code_digest()}"


def _named(cls: type, name: str, cfg: RollflowConfig, *args: Any) -> Any:
    return (
        ray.remote(cls)
        .options(
            name=name,
            namespace=cfg.cluster.namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=0,
            num_cpus=0,
        )
        .remote(*args)
    )


@dataclass
class RunActors:
    rollout: Any
    trainer: Any
    engines: list[Any]


def _engine(cfg: RollflowConfig, i: int) -> Any:
    """Engine i: an embedded/mock engine actor, a launched SGLang server, or a handle on an
    external SGLang server (`engine.urls`)."""
    name = actor_name(cfg.storage.run_name, f"engine-{i}")
    if cfg.engine.backend != "sglang":
        return _named(EngineActor, name, cfg, cfg.engine, i, cfg.cluster.actor_num_threads)
    if cfg.engine.urls:
        return _named(ExternalSGLangEngine, name, cfg, cfg.engine.urls[i])
    return _named(SGLangServerActor, name, cfg, cfg.engine, i)


def num_engines(cfg: RollflowConfig) -> int:
    if cfg.rollout.debug_train_only:
        return 0
    return len(cfg.engine.urls) if cfg.engine.backend == "sglang" and cfg.engine.urls else (
        cfg.engine.num_engines)


def get_or_create_actors(cfg: RollflowConfig) -> RunActors:
    run = cfg.storage.run_name
    engines = [_engine(cfg, i) for i in range(num_engines(cfg))]
    rollout = _named(RolloutManager, actor_name(run, "rollout"), cfg, cfg)
    trainer_cls = NullTrainActor if cfg.rollout.debug_rollout_only else TrainActor
    trainer = _named(trainer_cls, actor_name(run, "trainer"), cfg, cfg)
    urls = ray.get([e.url.remote() for e in engines])
    ray.get(rollout.set_engines.remote(urls))
    return RunActors(rollout=rollout, trainer=trainer, engines=engines)


def kill_run_actors(cfg: RollflowConfig) -> int:
    """Kill the run's actors; returns how many were alive."""
    run = cfg.storage.run_name
    roles = ["rollout", "trainer"] + [f"engine-{i}" for i in range(num_engines(cfg))]
    killed = 0
    for role in roles:
        try:
            ray.kill(ray.get_actor(actor_name(run, role), namespace=cfg.cluster.namespace))
            killed += 1
        except ValueError:
            pass
    return killed
