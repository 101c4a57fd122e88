"""Named, detached actors of one run: get them if they exist, create them if not.

Flow runs attach to these instead of reloading models, so a run's second step costs no
model load, and a driver that crashed can be re-run against the same warm actors.

With `cluster.placement` on (auto: on clusters with GPUs), the run's detached placement
group (named after the run) is reserved first, train rank i goes to train bundle i and
engine i to its first bundle, each asking for its share of the bundle (colocated runs split
a bundle between trainer and engine). Off, actors ask for no resources at all. More than
one train rank (`actor_num_nodes x actor_num_gpus_per_node`) makes the trainer a
data-parallel `TrainGroup`; one rank is the plain `TrainActor`.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import ray

from engines.cluster.placement import (
    ENGINE_SHARE,
    TRAIN_SHARE,
    Placement,
    ResourcePlan,
    create_placement,
    plan_resources,
    use_placement,
)
from engines.cluster.registry import (
    RunActor,
    actor_name,
    actor_options_env,
    cfg_run_key,
    remember_config,
    retire_stale_actors,
    run_actors,
    run_suffix,
    stop_run,
)
from engines.cluster.train_group import actor_exists, get_or_create_group, kill_group
from engines.config.run import RunConfig
from engines.inference.engine_actor import EngineActor
from engines.inference.sglang_launcher import ExternalSGLangEngine, SGLangServerActor
from engines.rollout.rollout_manager import RolloutManager
from engines.train.null_trainer import NullTrainActor
from engines.train.train_actor import TrainActor, collective_export
from storage.config import ConfigError
from storage.engine_pool import read_pool_request
from storage.run_layout import RunLayout

log = logging.getLogger(__name__)
_DRAIN_S = 30.0  # a removed engine finishes what it was sent before it is killed


def _named(
    cls: type, name: str, cfg: RunConfig, *args: Any, pin: dict[str, Any] | None = None
) -> Any:
    """`pin`: placement options (`Placement.actor_options`); None asks for no resources."""
    return (
        ray.remote(cls)
        .options(
            name=name,
            namespace=cfg.cluster.namespace,
            lifetime="detached",
            get_if_exists=True,
            max_restarts=0,
            runtime_env=actor_options_env(cfg),
            **(pin or {"num_cpus": 0}),
        )
        .remote(*args)
    )


@dataclass
class RunActors:
    rollout: Any
    trainer: Any
    engines: list[Any]
    urls: list[str] = field(default_factory=list)  # engine i's URL, asked once at attach
    # the number in each engine's actor name (`engine-<n>`); empty: engine i is `engine-i`.
    # A standby that took a lost engine's place keeps its own name.
    slots: list[int] = field(default_factory=list)
    standby: list[Any] = field(default_factory=list)  # idle engines (engine.standby_engines)
    standby_slots: list[int] = field(default_factory=list)

    def engine_slots(self) -> list[int]:
        return self.slots or list(range(len(self.engines)))


def _engine(cfg: RunConfig, i: int, placement: Placement | None) -> Any:
    """Engine i: an embedded/mock engine actor, a launched SGLang server, or a handle on an
    external SGLang server (`engine.urls`, which holds no resources of its own)."""
    name = actor_name(cfg, f"engine-{i}")
    if cfg.engine.backend == "sglang" and cfg.engine.urls:
        return _named(ExternalSGLangEngine, name, cfg, cfg.engine.urls[i])
    pin = None
    if placement is not None:
        share = ENGINE_SHARE[cfg.cluster.colocate]
        pin = placement.actor_options(placement.engine_bundles(i)[0], share)
    if cfg.engine.backend != "sglang":
        return _named(EngineActor, name, cfg, cfg.engine, i, cfg.cluster.actor_num_threads,
                      pin=pin)
    tp_size = cfg.cluster.rollout_num_gpus_per_engine
    base_gpu_id = placement.engine_gpus(i)[0] if placement is not None and placement.use_gpu else None
    return _named(SGLangServerActor, name, cfg, cfg.engine, i, tp_size, base_gpu_id, pin=pin)


def num_standby(cfg: RunConfig) -> int:
    """Standby engines the run keeps (`engine.standby_engines`); none for external servers
    and runs without engines."""
    if cfg.rollout.debug_train_only or cfg.engine.backend == "sglang":
        return 0
    return cfg.engine.standby_engines


def engine_bundles_for_pool(cfg: RunConfig, plan: ResourcePlan | None) -> int | None:
    """Engine bundles the pool may use: the placement plan's, less one for each standby
    engine (which takes a bundle of its own); None without placement (no limit)."""
    if plan is None:
        return None
    spare, bundles = num_standby(cfg), plan.num_engines
    if spare and spare >= bundles:
        raise ConfigError(
            f"engine.standby_engines={spare} leaves no engine bundle for the pool: "
            f"cluster.rollout_num_gpus reserves {bundles} engine(s) of "
            f"{plan.gpus_per_engine} GPU(s); raise it to hold the pool and the "
            f"standby engines")
    return bundles - spare


def num_engines(cfg: RunConfig) -> int:
    if cfg.rollout.debug_train_only:
        return 0
    return len(cfg.engine.urls) if cfg.engine.backend == "sglang" and cfg.engine.urls else (
        cfg.engine.num_engines)


def num_train_ranks(cfg: RunConfig) -> int:
    """Data-parallel trainer processes; a rollout-only run has one null trainer."""
    if cfg.rollout.debug_rollout_only:
        return 1
    return cfg.cluster.train_ranks


def rank_names(cfg: RunConfig) -> list[str]:
    """One rank keeps the plain `trainer` name; a group's ranks never do, so nothing can
    call one rank alone (it would wait forever in a collective)."""
    n = num_train_ranks(cfg)
    if n == 1:
        return [actor_name(cfg, "trainer")]
    return [actor_name(cfg, f"trainer-rank{i}") for i in range(n)]


def run_placement(cfg: RunConfig) -> Placement | None:
    """The run's placement group (reserved on first use), or None when placement is off."""
    if not use_placement(cfg.cluster):
        return None
    plan = plan_resources(cfg.cluster)
    if num_engines(cfg) > plan.num_engines and not cfg.engine.urls:
        raise ConfigError(
            f"engine.num_engines={num_engines(cfg)} needs more bundles than the cluster "
            f"section reserves for rollout ({plan.num_engines} engines of "
            f"{plan.gpus_per_engine}); raise cluster.rollout_num_gpus"
        )
    return create_placement(cfg.cluster, name=actor_name(cfg, "placement"))


def _trainer(cfg: RunConfig, placement: Placement | None) -> Any:
    names = rank_names(cfg)
    share = TRAIN_SHARE[cfg.cluster.colocate]

    def pin(rank: int) -> dict[str, Any] | None:
        return None if placement is None else placement.actor_options(
            placement.train_bundles[rank], share)

    if cfg.rollout.debug_rollout_only:
        return _named(NullTrainActor, names[0], cfg, cfg)
    if len(names) == 1:
        return _named(TrainActor, names[0], cfg, cfg, pin=pin(0))
    return get_or_create_group(
        names, cfg.cluster.namespace,
        lambda rank, world: _named(TrainActor, names[rank], cfg, cfg, rank, world, pin=pin(rank)),
        collective_export=collective_export(cfg),
        collective_push=cfg.cluster.colocate and cfg.train.weight_sync == "tensor",
    )


def _attach(cfg: RunConfig) -> Placement | None:
    """Replace the run's actors of other code or config, then reserve its placement."""
    retire_stale_actors(cfg)
    remember_config(cfg)
    return run_placement(cfg)


def get_or_create_trainer(cfg: RunConfig) -> Any:
    """The run's trainer alone (a plain actor or a TrainGroup), e.g. for a replay: no engines."""
    return _trainer(cfg, _attach(cfg))


def get_or_create_actors(cfg: RunConfig, pool: int | None = None) -> RunActors:
    """Look the run's actors up (creating, replacing or recreating what is missing, stale or
    dead) and remember the handles for `attached_actors`. The engines are `pool` of them
    (the pool a task attempt started with), else the pool the run is asked to have
    (`engine_pool_size`); engines beyond it are drained and killed once the rollout (and its
    router) no longer sends them anything."""
    spare = num_standby(cfg)
    placement = _attach(cfg)
    cap = engine_bundles_for_pool(cfg, None if placement is None else placement.plan)
    wanted = pool if pool is not None else num_engines(cfg)
    if cap is not None and spare and wanted > cap:
        raise ConfigError(
            f"{wanted} engine(s) and engine.standby_engines={spare} need {wanted + spare} "
            f"engine bundles; cluster.rollout_num_gpus reserves {cap + spare}: raise it")
    if pool is None:
        pool = engine_pool_size(cfg, cap)
    # the standbys are the engines numbered after the pool: they start (and load their
    # model) now, side by side with the rest, and nothing waits for them
    engines = [_engine(cfg, i, placement) for i in range(pool + spare)]
    rollout = _named(RolloutManager, actor_name(cfg, "rollout"), cfg, cfg)
    trainer = _trainer(cfg, placement)
    urls = ray.get([e.url.remote() for e in engines[:pool]])
    ray.get(rollout.set_engines.remote(urls))
    retire_surplus_engines(cfg, pool + spare)
    actors = RunActors(rollout=rollout, trainer=trainer, engines=engines[:pool], urls=urls,
                       slots=list(range(pool)), standby=engines[pool:],
                       standby_slots=list(range(pool, pool + spare)))
    _ATTACHED[_attach_key(cfg)] = actors
    return actors


# -- the elastic pool ------------------------------------------------------------------
def engine_pool_size(cfg: RunConfig, cap: int | None = None) -> int:
    """Engines the run has now: the pool `rollflow engines add|remove` asked for (the run
    directory's engines.json, storage/engine_pool.py), else `engine.num_engines`; at most
    `cap`, the engines the run's placement group reserves bundles for. Runs on external
    servers (`engine.urls`) and runs without engines keep their count."""
    configured = num_engines(cfg)
    if cfg.rollout.debug_train_only or cfg.engine.urls:
        return configured
    s = cfg.storage
    store = RunLayout.open(s.uri, s.run_name, s.endpoint_url, s.store_options()).store
    request = read_pool_request(store)
    wanted = configured if request is None else request.target(cfg.engine.num_engines)
    if cap is not None and wanted > cap:
        log.warning("run %r: engine pool of %d asked for, but its placement group reserves "
                    "%d engine(s) (cluster.rollout_num_gpus); running %d", s.run_name, wanted,
                    cap, cap)
        wanted = cap
    return wanted


def apply_engine_pool(cfg: RunConfig, actors: RunActors) -> RunActors:
    """At a weight push: the pool as asked for now. Unchanged, the same handles; grown or
    shrunk, the run's actors looked up again (new engines start and join the rollout's
    rotation and router; removed ones are drained and killed). New engines hold the initial
    weights: the caller brings them to the current version, as after `replace_lost_engines`."""
    if engine_pool_size(cfg) == len(actors.engines):  # (one small read per step)
        return actors
    cap = engine_bundles_for_pool(
        cfg, plan_resources(cfg.cluster) if use_placement(cfg.cluster) else None)
    if engine_pool_size(cfg, cap) == len(actors.engines):
        return actors
    _ATTACHED.pop(_attach_key(cfg), None)
    resized = get_or_create_actors(cfg)
    log.warning("run %r: engine pool %d -> %d", cfg.storage.run_name, len(actors.engines),
                len(resized.engines))
    return resized


def _engine_index(actor: RunActor) -> int | None:
    prefix, _, index = actor.role.partition("-")
    return int(index) if prefix == "engine" and index.isdigit() else None


def retire_surplus_engines(cfg: RunConfig, keep: int) -> int:
    """Drain and kill the run's engines numbered `keep` and up (a pool made smaller, or a
    rerun with fewer `engine.num_engines`); returns how many. The caller has already handed
    the rollout the engines that stay, so nothing new reaches these; each is asked to shut
    down (its HTTP server finishes the requests it holds) for up to `_DRAIN_S`, then killed,
    its name freed. Its placement bundle stays with the run for a later `engines add`."""
    ns, suffix = cfg.cluster.namespace, run_suffix(cfg)
    surplus = [a for a in _run_engines(cfg)
               if a.suffix == suffix and (_engine_index(a) or 0) >= keep]
    if not surplus:
        return 0
    handles = [ray.get_actor(a.name, namespace=ns) for a in surplus]
    try:
        ray.get([h.shutdown.remote() for h in handles], timeout=_DRAIN_S)
    except Exception:  # a dead or hung one: SIGKILLed where it runs here (ray.kill may not)
        for handle in handles:
            _kill_local_process(handle)
    names = [a.name for a in surplus]
    kill_group(names, ns)
    log.warning("run %r: removed %d engine(s) from its pool", cfg.storage.run_name,
                len(names))
    return len(names)


def _run_engines(cfg: RunConfig) -> list[RunActor]:
    return [a for a in run_actors(cfg.cluster.namespace, cfg_run_key(cfg))
            if _engine_index(a) is not None]


# Handles this process looked up, by (namespace, run, actor suffix). The train flow looks
# its actors up once; each step (or step flow run) then reuses the handles instead of about
# ten Ray round trips (GCS lookups, placement, two actor calls), most of a mock step
# (bench/RESULTS.md, "Orchestration").
# An actor that died since fails its task, whose retry looks everything up again.
_ATTACHED: dict[tuple[str, str, str], RunActors] = {}


def _attach_key(cfg: RunConfig) -> tuple[str, str, str]:
    return cfg.cluster.namespace, cfg_run_key(cfg), run_suffix(cfg)


def attached_actors(cfg: RunConfig) -> RunActors:
    """The handles this process last looked up for the run's actors of this code and config,
    else `get_or_create_actors(cfg)`."""
    cached = _ATTACHED.get(_attach_key(cfg))
    return cached if cached is not None else get_or_create_actors(cfg)


def replace_lost_engines(
    cfg: RunConfig, actors: RunActors, lost_urls: list[str], timeout_s: float = 60.0
) -> RunActors:
    """New engines in place of the ones the rollout found dead or hung: the old actor is
    killed (a hung one is alive to Ray), its name freed, and the run's actors looked up
    again, which creates the engine anew and hands the rollout the new URL set."""
    lost = [i for i, url in enumerate(actors.urls) if url in lost_urls]
    for i in lost:
        _kill_local_process(actors.engines[i])
    slots = actors.engine_slots()
    names = [actor_name(cfg, f"engine-{slots[i]}") for i in lost]
    kill_group(names, cfg.cluster.namespace, wait_s=timeout_s)  # waits for the names to free
    if any(actor_exists(n, cfg.cluster.namespace) for n in names):
        raise TimeoutError(f"engine actors {names} still exist {timeout_s:g} s after kill")
    _ATTACHED.pop(_attach_key(cfg), None)
    if 0 < len(lost) <= len(actors.standby):
        try:
            return _promote_standby(cfg, actors, lost)
        except ray.exceptions.RayError as exc:  # a standby died too: start new engines
            log.warning("run %r: a standby engine did not answer (%s); starting new engines",
                        cfg.storage.run_name, exc)
    return get_or_create_actors(cfg, pool=len(actors.engines))


def _promote_standby(cfg: RunConfig, actors: RunActors, lost: list[int]) -> RunActors:
    """Standby engines in the lost ones' places (already loaded: no process to start, no
    model to load; the caller brings them to the pool's weight version), and a new standby
    under each freed name (and in its freed bundle), started in the background."""
    placement = run_placement(cfg)  # the run's group, found by name: no new reservation
    engines, urls, slots = list(actors.engines), list(actors.urls), actors.engine_slots()
    standby, standby_slots = list(actors.standby), list(actors.standby_slots)
    freed = [slots[i] for i in lost]
    for i in lost:
        engines[i], slots[i] = standby.pop(0), standby_slots.pop(0)
        urls[i] = ray.get(engines[i].url.remote())  # at once, unless it is still starting
    for slot in freed:
        standby.append(_engine(cfg, slot, placement))
        standby_slots.append(slot)
    ray.get(actors.rollout.set_engines.remote(urls))
    promoted = RunActors(rollout=actors.rollout, trainer=actors.trainer, engines=engines,
                         urls=urls, slots=slots, standby=standby, standby_slots=standby_slots)
    _ATTACHED[_attach_key(cfg)] = promoted
    log.warning("run %r: standby engine(s) %s took the place of lost engine(s) %s",
                cfg.storage.run_name, [slots[i] for i in lost], freed)
    return promoted


def _kill_local_process(actor: Any) -> None:
    """SIGKILL an actor's process when it runs on this node: `ray.kill` asks the process to
    exit, which a stopped (SIGSTOP) or wedged one never does, and it would hold its memory
    and its name until Ray gives up on it. The pid comes from the GCS's actor table, which
    every head has (`ray.util.state` asks the dashboard, which a head without `ray[default]`
    lacks: there the kill waited for Ray).

    Only a live actor's own worker is killed: the table keeps a dead actor's pid, which the
    machine may since have given to any process (pids wrap at 32768 here), so a dead actor
    (nothing left to kill), this process, or a process that is not a Ray worker is left
    alone."""
    try:
        info = ray._private.state.actors(actor._actor_id.hex())  # pinned ray==2.60.0
        pid, node = int(info.get("Pid") or 0), info.get("Address", {}).get("NodeID")
        if (info.get("State") == "ALIVE" and pid and pid != os.getpid()
                and node == ray.get_runtime_context().get_node_id() and _is_ray_worker(pid)):
            os.kill(pid, signal.SIGKILL)
    except Exception:  # best effort: ray.kill below still frees the name and resources
        pass


def _is_ray_worker(pid: int) -> bool:
    """Whether `pid` is a Ray worker process (Ray names them `ray::<Actor>`, `ray::IDLE`)."""
    import psutil

    try:
        cmdline = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    return bool(cmdline) and cmdline[0].startswith("ray::")


def kill_run_actors(cfg: RunConfig) -> int:
    """Kill the run's actors (of any code or config) and release its placement group;
    returns actors killed. Other runs are untouched."""
    for key in [k for k in _ATTACHED if k[:2] == (cfg.cluster.namespace, cfg_run_key(cfg))]:
        del _ATTACHED[key]
    return stop_run(cfg.cluster.namespace, cfg_run_key(cfg))
