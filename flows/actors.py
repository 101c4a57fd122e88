"""Named, detached actors of one run: get them if they exist, create them if not.

Flow runs attach to these instead of reloading models, so a run's second step costs no
model load, and a driver that crashed can be re-run against the same warm actors.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util import get_placement_group, remove_placement_group

from engines.placement import create_placement, use_placement
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


def _named(
    cls: type, name: str, cfg: RollflowConfig, *args: Any, placement: dict[str, Any] | None = None
) -> Any:
    return (
        ray.remote(cls)
        .options(
            name=name,
            namespace=cfg.cluster.namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=0,
            **(placement or {"num_cpus": 0}),
        )
        .remote(*args)
    )


@dataclass
class RunActors:
    rollout: Any
    trainer: Any
    engines: list[Any]


def _engine(cfg: RollflowConfig, i: int, placement: dict[str, Any] | None) -> Any:
    """Engine i: an embedded/mock engine actor, a launched SGLang server, or a handle on an
    external SGLang server (`engine.urls`)."""
    name = actor_name(cfg.storage.run_name, f"engine-{i}")
    if cfg.engine.backend != "sglang":
        return _named(EngineActor, name, cfg, cfg.engine, i, cfg.cluster.actor_num_threads,
                      placement=placement)
    if cfg.engine.urls:
        return _named(ExternalSGLangEngine, name, cfg, cfg.engine.urls[i])
    return _named(SGLangServerActor, name, cfg, cfg.engine, i, placement=placement)


def num_engines(cfg: RollflowConfig) -> int:
    if cfg.rollout.debug_train_only:
        return 0
    return len(cfg.engine.urls) if cfg.engine.backend == "sglang" and cfg.engine.urls else (
        cfg.engine.num_engines)


def placement_options(cfg: RollflowConfig) -> tuple[dict[str, Any] | None, list[Any]]:
    """(trainer options, per-engine options) pinning actors to the run's placement group,
    or (None, [None...]) when placement is off (CPU-only default: actors take no CPUs)."""
    n = num_engines(cfg)
    if not use_placement(cfg.cluster):
        return None, [None] * n
    placement = create_placement(cfg.cluster, name=actor_name(cfg.storage.run_name, "placement"))
    share = 0.4 if cfg.cluster.colocate else 1.0  # slime's colocated split of one GPU
    trainer = placement.actor_options(placement.train_bundles[0], share)
    engines = [
        placement.actor_options(placement.engine_bundles(i)[0], 0.2 if cfg.cluster.colocate else 1.0)
        for i in range(n)
    ]
    return trainer, engines


def get_or_create_actors(cfg: RollflowConfig) -> RunActors:
    run = cfg.storage.run_name
    trainer_placement, engine_placements = placement_options(cfg)
    engines = [_engine(cfg, i, p) for i, p in enumerate(engine_placements)]
    rollout = _named(RolloutManager, actor_name(run, "rollout"), cfg, cfg)
    trainer_cls = NullTrainActor if cfg.rollout.debug_rollout_only else TrainActor
    trainer = _named(trainer_cls, actor_name(run, "trainer"), cfg, cfg, placement=trainer_placement)
    urls = ray.get([e.url.remote() for e in engines])
    ray.get(rollout.set_engines.remote(urls))
    return RunActors(rollout=rollout, trainer=trainer, engines=engines)


def kill_run_actors(cfg: RollflowConfig) -> int:
    """Kill the run's actors and release its placement group; returns actors killed."""
    run = cfg.storage.run_name
    roles = ["rollout", "trainer"] + [f"engine-{i}" for i in range(num_engines(cfg))]
    killed = 0
    for role in roles:
        try:
            ray.kill(ray.get_actor(actor_name(run, role), namespace=cfg.cluster.namespace))
            killed += 1
        except ValueError:
            pass
    with contextlib.suppress(ValueError):
        remove_placement_group(get_placement_group(actor_name(run, "placement")))
    return killed
