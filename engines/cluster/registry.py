"""Names of a run's detached actors, and finding, replacing and stopping them.

A run's actors are named `{run}:{role}@{code}.{config}`: `code` hashes rollflow's source and
`config` the config sections that shaped the actors. Detached actors outlive the driver, so
a rerun with the same code and config attaches to them warm (resume stays fast), while a
rerun after a code change or a config fix must not: `retire_stale_actors` kills every actor
(and placement group) of the run whose suffix differs, and says which sections changed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from engines.cluster.train_group import kill_group
from engines.config.run import ACTOR_SECTIONS, RunConfig

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]
_KV_NAMESPACE = "rollflow-configs"

# Fields only the driver reads: changing them (e.g. more steps to extend a run) keeps the
# run's actors. A section mapped to None is driver-only as a whole. A changed
# `engine.num_engines` grows or shrinks the engine pool, `engine.standby_engines` the idle
# engines beside it (engines.cluster.actors).
DRIVER_ONLY: dict[str, set[str] | None] = {
    "rollout": {"num_rollout"},
    "engine": {"num_engines", "standby_engines"},
    "cluster": {"keep_actors", "address"},
    "eval": {"eval_interval", "before_train"},
    "data": {"preflight_token_rows"},
    "logging": None,
}


@functools.cache
def code_digest() -> str:
    """Hash of rollflow's own source. Detached actors outlive the driver, so after an upgrade
    (or a `git pull`) a rerun must not attach to actors still running the old code."""
    h = hashlib.sha1()
    for package in ("flows", "tasks", "engines", "storage"):
        for path in sorted((ROOT / package).rglob("*.py")):
            h.update(path.relative_to(ROOT).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:8]


# How long torch's OpenMP threads (libgomp) spin at a barrier before they sleep, in spins
# (libgomp reckons about 100,000 a millisecond). Its default (300000) is long: beside other
# programs, the waiting thread of a 2-thread train step holds a core its partner needs (a
# main-job train step beside two CPU burners: 4.4-10.1 s, against 1.0-1.2 s idle). Too short
# a spin costs the idle machine instead: between a small step's many short ops the partner
# sleeps, and on a virtual machine each wake-up is slow (the main job's SFT train steps on
# the 2-core Xeon VM: 59-62 s at 1000, 41-47 s at 30000). 30000 keeps the idle speed of the
# long spin and the busy ratio of the short one (a 3-step GRPO run beside two burners: 2.42x
# idle, 2.24x at 1000). Figures: bench/RESULTS.md, "Busy machine".
OPENMP_WAIT = {"GOMP_SPINCOUNT": "30000"}
_OPENMP_WAIT_KEYS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def openmp_wait_env(driver_env: Mapping[str, str]) -> dict[str, str]:
    """The actors' OpenMP wait settings: the driver's own, if its environment sets any (an
    actor's environment is the Ray head's, not the driver's), else `OPENMP_WAIT`."""
    own = {k: driver_env[k] for k in _OPENMP_WAIT_KEYS if k in driver_env}
    return own or dict(OPENMP_WAIT)


def worker_pythonpath(driver_env: Mapping[str, str]) -> list[str]:
    """The entries rollflow puts on its actors' PYTHONPATH whatever the driver's directory:
    the driver's own PYTHONPATH, then rollflow itself."""
    entries = [*driver_env.get("PYTHONPATH", "").split(os.pathsep), str(ROOT)]
    return list(dict.fromkeys(p for p in entries if p))


def head_worker_env(driver_env: Mapping[str, str]) -> dict[str, str]:
    """What a head rollflow starts gives every worker (`engines/cluster/head.py`), so that
    the actors of a driver in rollflow's own directory (the main job, the tests) need no
    runtime_env (`actor_options_env`): the OpenMP wait settings and `worker_pythonpath`.
    Not the driver's working directory: every Ray daemon of the head would import from it."""
    return {**openmp_wait_env(driver_env), "PYTHONPATH": os.pathsep.join(worker_pythonpath(driver_env))}


def actor_runtime_env(cfg: RunConfig) -> dict[str, Any]:
    """The Ray runtime_env of the run's actors: the driver's working directory, its
    PYTHONPATH and rollflow itself on PYTHONPATH (so a hook next to the user's config imports
    in every actor, wherever the Ray head was started), the OpenMP wait settings
    (`openmp_wait_env`), plus `cluster.runtime_env` (its env_vars win; a PYTHONPATH there
    goes first, not replaced)."""
    user = dict(cfg.cluster.runtime_env)
    env_vars = {**openmp_wait_env(os.environ), **user.pop("env_vars", {})}
    entries = [*str(env_vars.get("PYTHONPATH", "")).split(os.pathsep), os.getcwd(),
               *worker_pythonpath(os.environ)]
    env_vars["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in entries if p))
    return {**user, "env_vars": env_vars}


# Ray starts the worker of an actor with a runtime_env through setup_worker.py, which execs a
# second interpreter: about 0.45 CPU-s and 0.3 s of wall time more an actor of a mock run
# (bench/RESULTS.md, "CI cost"). So the runtime_env is left off where the head's workers
# already run as it would make them run.
_WORKER_ENV_KEY = "head-worker-env"
# (GCS address, the driver's node) -> what a worker has: a head started again on the same
# port is another node
_head_worker_envs: dict[tuple[str, str], dict[str, Any] | None] = {}


def has_all(worker: Mapping[str, Any], env_vars: Mapping[str, str]) -> bool:
    """Whether a worker that reported `worker` (`connected_head_worker_env`) runs as one given
    `env_vars` would: each variable at the same value, and each PYTHONPATH entry (resolved
    where the worker runs) on its own PYTHONPATH."""
    env = worker["env"]
    for key, value in env_vars.items():
        if key != "PYTHONPATH":
            if env.get(key) != value:
                return False
            continue
        have = set(worker["pythonpath"])
        if any(os.path.realpath(p) not in have for p in value.split(os.pathsep) if p):
            return False
    return True


def connected_head_worker_env() -> dict[str, Any] | None:
    """What a worker of the connected head has without a runtime_env: its OpenMP settings
    and its PYTHONPATH entries, resolved. Asked once per head by a task and kept in its KV
    store; None on a cluster of several nodes, whose workers may each have another
    environment, or where the task failed."""
    from ray.experimental import internal_kv

    def report(keys: tuple[str, ...]) -> dict[str, Any]:
        # (nested: pickled by value, so the worker need not import rollflow to run it)
        import os

        path = [os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p]
        return {"env": {k: os.environ[k] for k in keys if k in os.environ}, "pythonpath": path,
                "pid": os.getpid()}

    context = ray.get_runtime_context()
    head = (context.gcs_address, context.get_node_id())
    if head in _head_worker_envs:
        return _head_worker_envs[head]
    seen: dict[str, Any] | None = None
    if sum(1 for node in ray.nodes() if node["Alive"]) == 1:
        raw = internal_kv._internal_kv_get(_WORKER_ENV_KEY, namespace=_KV_NAMESPACE)
        if raw is not None:
            seen = json.loads(raw)
        else:
            # max_calls=1: its worker exits after, where an idle one would stay up for
            # the head's life at ~0.5 CPU-s a minute (bench/RESULTS.md, "CI cost")
            probe: Any = ray.remote(num_cpus=0, max_retries=1, max_calls=1)(report)
            try:
                seen = ray.get(probe.options(runtime_env={}).remote(_OPENMP_WAIT_KEYS),
                               timeout=120)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.warning("could not ask the Ray head's workers for their environment (%s); "
                            "the run's actors get a runtime_env", exc)
            else:
                internal_kv._internal_kv_put(_WORKER_ENV_KEY, json.dumps(seen), overwrite=True,
                                             namespace=_KV_NAMESPACE)
    _head_worker_envs[head] = seen
    return seen


def actor_options_env(cfg: RunConfig) -> dict[str, Any]:
    """The runtime_env to create the run's actors with: `actor_runtime_env`, or none at all
    where the head's workers already have every part of it (only env_vars asked for, and
    `has_all`)."""
    wanted = actor_runtime_env(cfg)
    if set(wanted) != {"env_vars"}:
        return wanted
    worker = connected_head_worker_env()
    return {} if worker is not None and has_all(worker, wanted["env_vars"]) else wanted


def _digest(obj: Any) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:8]


def section_digests(cfg: RunConfig) -> dict[str, str]:
    """Section -> digest of what the actors see of it (driver-only fields left out)."""
    out: dict[str, str] = {}
    for name in ACTOR_SECTIONS:
        skip = DRIVER_ONLY.get(name, set())
        if skip is None:
            continue
        out[name] = _digest(getattr(cfg, name).model_dump(mode="json", exclude=skip))
    # config dumps redact secrets; a changed credential must still replace the actors
    out["storage"] = _digest([out["storage"], cfg.storage.storage_options])
    out["runtime_env"] = _digest(actor_runtime_env(cfg))
    return out


def config_digest(cfg: RunConfig) -> str:
    return _digest(section_digests(cfg))


def run_suffix(cfg: RunConfig) -> str:
    return f"{code_digest()}.{config_digest(cfg)}"


def run_key(uri: str, run_name: str) -> str:
    """`{run_name}~{where}`: the run as its actors are named, `where` hashing the run
    directory. Two runs of one name under different roots (two checkouts of an example
    both train `arithmetic-grpo`) are different runs: keyed by name alone, each driver took
    the other's actors for stale ones of its own and killed them."""
    uri = _canonical_root(uri)
    where = hashlib.sha1(f"{uri.rstrip('/')}/{run_name}".encode()).hexdigest()[:6]
    return f"{run_name}~{where}"


def _canonical_root(uri: str) -> str:
    """One spelling per local directory (`runs`, `./runs/`, `file:///abs/runs` and a symlink
    to it are one root), so `runs stop` finds a run however its root was written."""
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if "://" in uri:
        return uri.rstrip("/")
    return os.path.realpath(os.path.expanduser(uri))


def cfg_run_key(cfg: RunConfig) -> str:
    return run_key(cfg.storage.uri, cfg.storage.run_name)


def actor_name(cfg: RunConfig, role: str) -> str:
    return f"{cfg_run_key(cfg)}:{role}@{run_suffix(cfg)}"


def _kv_key(namespace: str, run: str, suffix: str) -> str:
    return f"{namespace}/{run}@{suffix}"


def remember_config(cfg: RunConfig) -> None:
    """Keep the section digests behind this suffix in Ray's KV store, so a later rerun with a
    different config can say which sections changed."""
    from ray.experimental import internal_kv

    digests = section_digests(cfg)
    suffix = f"{code_digest()}.{_digest(digests)}"  # run_suffix(cfg), without digesting twice
    internal_kv._internal_kv_put(_kv_key(cfg.cluster.namespace, cfg_run_key(cfg), suffix),
                                 json.dumps(digests), overwrite=True, namespace=_KV_NAMESPACE)


def _remembered(namespace: str, run: str, suffix: str) -> dict[str, str] | None:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(_kv_key(namespace, run, suffix), namespace=_KV_NAMESPACE)
    return None if raw is None else dict(json.loads(raw))


def _forget(namespace: str, run: str, suffix: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_kv_key(namespace, run, suffix), namespace=_KV_NAMESPACE)


@dataclass(frozen=True)
class RunActor:
    run: str  # the run key, `{run_name}~{where}` (`run_key`)
    role: str
    suffix: str
    name: str

    @property
    def run_name(self) -> str:
        return self.run.partition("~")[0]

    def of_run(self, run: str) -> bool:
        """Whether this is an actor of `run`: a run key, or a run name (any location)."""
        return self.run == run if "~" in run else self.run_name == run

    @staticmethod
    def parse(name: str) -> RunActor | None:
        run, sep, rest = name.partition(":")
        role, at, suffix = rest.partition("@")
        if not (sep and at and run and role):
            return None
        return RunActor(run, role, suffix, name)


def run_actors(namespace: str | None, run: str | None = None) -> list[RunActor]:
    """The rollflow actors alive in `namespace` (None: in any namespace; of one run, if
    given: a run key, or a run name for every run of that name)."""
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if namespace is not None and entry["namespace"] != namespace:
            continue
        actor = RunActor.parse(entry["name"])
        if actor is not None and (run is None or actor.of_run(run)):
            found.append(actor)
    return sorted(found, key=lambda a: a.name)


def _placement_groups(run: str) -> list[RunActor]:
    from ray.util import placement_group_table

    groups = []
    for g in placement_group_table().values():
        parsed = RunActor.parse(g.get("name") or "")
        if g["state"] != "REMOVED" and parsed and parsed.of_run(run):
            groups.append(parsed)
    return groups


def stop_run(namespace: str, run: str, keep_suffix: str | None = None) -> int:
    """Kill run `run`'s actors and release its placement groups (those of `keep_suffix`
    excepted); other runs are untouched. Returns actors killed."""
    from engines.cluster.placement import remove_named_placement

    stale = [a for a in run_actors(namespace, run) if a.suffix != keep_suffix]
    killed = kill_group([a.name for a in stale], namespace)  # names free on return
    for group in _placement_groups(run):
        if group.suffix != keep_suffix:
            remove_named_placement(group.name)
    for actor in {(a.run, a.suffix) for a in stale}:
        _forget(namespace, *actor)
    return killed


def changed_sections(cfg: RunConfig, old_suffix: str) -> list[str]:
    """What differs between the actors of `old_suffix` and `cfg`, in words."""
    old_code, _, _ = old_suffix.partition(".")
    what = [] if old_code == code_digest() else ["rollflow code"]
    before = _remembered(cfg.cluster.namespace, cfg_run_key(cfg), old_suffix) or {}
    now = section_digests(cfg)
    what += [name for name, digest in now.items() if before and before.get(name) != digest]
    return what or ["config"]


def retire_stale_actors(cfg: RunConfig) -> int:
    """Replace, rather than reuse, actors this run left with other code or config: kill them
    (and their placement group) and say so in one line. Returns actors killed."""
    ns, run, current = cfg.cluster.namespace, cfg_run_key(cfg), run_suffix(cfg)
    held = [*run_actors(ns, run), *_placement_groups(run)]  # a group alone holds resources too
    stale = {a.suffix for a in held if a.suffix != current}
    if not stale:
        return 0
    what = sorted({w for s in stale for w in changed_sections(cfg, s)})
    killed = stop_run(ns, run, keep_suffix=current)
    log.warning("run %r: replaced %d actor(s) started with different %s",
                cfg.storage.run_name, killed, ", ".join(what))
    return killed


def get_run_actor(namespace: str, run: str, role: str) -> Any:
    """The live actor playing `role` in run `run` (a key or a name), whatever its suffix
    (ValueError if none, or several)."""
    matches = [a for a in run_actors(namespace, run) if a.role == role]
    if len(matches) != 1:
        raise ValueError(f"run {run!r} has {len(matches)} live {role!r} actors in {namespace!r}")
    return ray.get_actor(matches[0].name, namespace=namespace)
