"""Placement groups for the train group and the rollout engines, as in slime's
`placement_group.py`.

One placement group holds one bundle per GPU, `{GPU: 1, CPU: 1}` (`{CPU: 1}` on a cluster
without GPUs, so the same code path runs in CI). Ray numbers bundles in creation order, which
says nothing about where they landed, so a probe actor in each bundle reports its node IP and
GPU id and the bundles are ordered by (node IP, GPU id). Ranks then follow the hardware: rank
0..n-1 of the train group fill node after node, and an engine spanning several GPUs gets
neighbouring GPUs of one node.

```
ordered bundles:   [ n0:g0  n0:g1  n0:g2  n0:g3 | n1:g0  n1:g1 ]
disaggregated:       train (actor_num_nodes x   | rollout (rollout_num_gpus)
                     actor_num_gpus_per_node)   ^ rollout_offset
colocated:           train and rollout both use [0, actor_num_nodes x actor_num_gpus_per_node)
```

The group is detached and named after the run, so a rerun of the driver finds it again
instead of reserving the resources twice. The bundle order is probed once, when the group is
created, and kept in Ray's KV store next to it: a probe needs a free slot in its bundle, and
once the trainer and engines fill their bundles a second probe would wait forever, hanging
every flow run after the first.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from typing import Any

from engines.config.cluster import ClusterConfig
from storage.config import ConfigError

# Share of a bundle each actor asks for. Colocated, the trainer and an engine share a bundle
# (slime gives them 0.4 / 0.2 of a GPU); the rest stays free. On CPU bundles the same
# fractions apply to the bundle's CPU.
TRAIN_SHARE = {False: 1.0, True: 0.4}
ENGINE_SHARE = {False: 1.0, True: 0.2}
_KV_NAMESPACE = "rollflow-placement"


@dataclass(frozen=True)
class ResourcePlan:
    """How many bundles, and where the rollout engines' share starts (pure arithmetic)."""

    num_train: int
    num_rollout: int
    gpus_per_engine: int
    colocate: bool

    @property
    def rollout_offset(self) -> int:
        return 0 if self.colocate else self.num_train

    @property
    def num_bundles(self) -> int:
        return self.num_train if self.colocate else self.num_train + self.num_rollout

    @property
    def num_engines(self) -> int:
        return self.num_rollout // self.gpus_per_engine


def plan_resources(cfg: ClusterConfig) -> ResourcePlan:
    num_train = cfg.train_ranks
    if cfg.colocate:
        if cfg.rollout_num_gpus not in (None, num_train):
            raise ConfigError(
                f"cluster.rollout_num_gpus={cfg.rollout_num_gpus} must equal "
                f"cluster.actor_num_nodes x cluster.actor_num_gpus_per_node={num_train} "
                "when cluster.colocate is true"
            )
        num_rollout = num_train
    else:
        num_rollout = cfg.rollout_num_gpus or cfg.rollout_num_gpus_per_engine
    if num_rollout % cfg.rollout_num_gpus_per_engine:
        raise ConfigError(
            f"cluster.rollout_num_gpus={num_rollout} is not a multiple of "
            f"cluster.rollout_num_gpus_per_engine={cfg.rollout_num_gpus_per_engine}"
        )
    return ResourcePlan(num_train, num_rollout, cfg.rollout_num_gpus_per_engine, cfg.colocate)


@dataclass(frozen=True)
class BundleInfo:
    """Where bundle `index` landed; `gpu_id` is -1 for CPU-only bundles."""

    index: int
    node_ip: str
    gpu_id: int


def _ip_key(ip: str) -> tuple[int, int | str]:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:  # a hostname: after all IPs, alphabetical
        return (1, ip)


def order_bundles(infos: list[BundleInfo]) -> list[BundleInfo]:
    """By node IP (numerically: 10.0.0.9 before 10.0.0.10), then GPU id, then index."""
    return sorted(infos, key=lambda b: (_ip_key(b.node_ip), b.gpu_id, b.index))


@dataclass
class Placement:
    """A ready placement group and the bundle indices of each role, in hardware order."""

    pg: Any  # ray.util.placement_group.PlacementGroup
    plan: ResourcePlan
    bundles: list[BundleInfo]  # ordered
    use_gpu: bool

    @property
    def train_bundles(self) -> list[int]:
        return [b.index for b in self.bundles[: self.plan.num_train]]

    @property
    def rollout_bundles(self) -> list[int]:
        start = self.plan.rollout_offset
        return [b.index for b in self.bundles[start : start + self.plan.num_rollout]]

    def engine_bundles(self, engine: int) -> list[int]:
        """The `rollout_num_gpus_per_engine` neighbouring bundles of engine `engine`."""
        if not 0 <= engine < self.plan.num_engines:
            raise IndexError(f"engine {engine} of {self.plan.num_engines}")
        n = self.plan.gpus_per_engine
        return self.rollout_bundles[engine * n : (engine + 1) * n]

    def engine_gpus(self, engine: int) -> list[int]:
        """GPU ids of engine `engine`'s bundles. One SGLang server drives them all, from
        `--base-gpu-id` up, so they must be consecutive GPUs of one node."""
        by_index = {b.index: b for b in self.bundles}
        infos = [by_index[i] for i in self.engine_bundles(engine)]
        gpus = [b.gpu_id for b in infos]
        if len({b.node_ip for b in infos}) > 1 or gpus != list(range(gpus[0], gpus[0] + len(gpus))):
            where = ", ".join(f"{b.node_ip}:gpu{b.gpu_id}" for b in infos)
            raise ConfigError(
                f"engine {engine} needs cluster.rollout_num_gpus_per_engine="
                f"{self.plan.gpus_per_engine} consecutive GPUs of one node, got {where}"
            )
        return gpus

    def actor_options(self, bundle_index: int, fraction: float = 1.0) -> dict[str, Any]:
        """`.options(**...)` for an actor pinned to one bundle; `fraction` < 1 lets a
        colocated trainer and engine share a GPU (slime gives each 0.4 / 0.2)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        resource = {"num_cpus": fraction}
        if self.use_gpu:
            resource["num_gpus"] = fraction
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.pg,
            placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        )
        return {"scheduling_strategy": strategy, **resource}

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


def _where() -> tuple[str, int]:
    """A probe task's node IP and GPU id (a task, not an actor: it reuses pooled workers)."""
    import ray

    gpu_ids = ray.get_gpu_ids()
    return ray.util.get_node_ip_address(), int(gpu_ids[0]) if gpu_ids else -1


def use_placement(cfg: ClusterConfig) -> bool:
    """`cluster.placement`: auto reserves bundles only on clusters with GPUs (on CPU-only
    machines actors otherwise take no CPU slot, so any number of runs share one head)."""
    return cfg.placement == "always" or (cfg.placement == "auto" and cluster_has_gpus())


def cluster_has_gpus() -> bool:
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) > 0


def probe_bundles(
    pg: Any, num_bundles: int, use_gpu: bool, timeout_s: float = 60.0
) -> list[BundleInfo]:
    """Where each bundle landed. A GPU probe must hold a sliver of the bundle's GPU to learn
    its id, so this only runs on a fresh group (see the module docstring)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe: Any = ray.remote(_where)
    resource = {"num_gpus": 0.01, "num_cpus": 0} if use_gpu else {"num_cpus": 0}
    refs = [
        probe.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            max_retries=0, **resource,
        ).remote()
        for i in range(num_bundles)
    ]
    try:
        where = ray.get(refs, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as exc:
        for ref in refs:
            ray.cancel(ref)
        raise RuntimeError(
            f"bundle probes of placement group {pg.id.hex()} did not run within {timeout_s:.0f}s"
            " (are its bundles already full?)"
        ) from exc
    return [BundleInfo(i, ip, gpu) for i, (ip, gpu) in enumerate(where)]


def _check_fits_local_head(plan: ResourcePlan, bundle: dict[str, float]) -> None:
    """Fail at once when the local head (no `cluster.address`: a fixed set of resources,
    no autoscaler) has fewer GPUs or CPUs in all than the bundles need: waiting for them
    could only end in the timeout. A one-GPU machine meets this with the default split of
    one engine GPU plus one trainer GPU."""
    import ray

    total = ray.cluster_resources()
    short = {key: (plan.num_bundles * amount, total.get(key, 0.0))
             for key, amount in bundle.items() if total.get(key, 0.0) < plan.num_bundles * amount}
    if not short:
        return
    has = ", ".join(f"{key}: needs {need:g}, has {have:g}" for key, (need, have) in short.items())
    split = ("" if plan.colocate else
             f" (the train group's {plan.num_train} plus the engines' {plan.num_rollout})")
    raise ConfigError(
        f"the local Ray head cannot hold the run's {plan.num_bundles} x {bundle} bundles"
        f"{split}: {has}. On one machine: cluster.colocate=true (engines and trainer share "
        "the train group's bundles), fewer of them (cluster.actor_num_gpus_per_node, "
        "cluster.rollout_num_gpus), or cluster.placement=never (actors not pinned)"
    )


def _missing_resources(num_bundles: int, bundle: dict[str, float]) -> str:
    import ray

    free, total = ray.available_resources(), ray.cluster_resources()
    return ", ".join(
        f"{key}: needs {num_bundles * amount:g}, free {free.get(key, 0.0):g} of "
        f"{total.get(key, 0.0):g}"
        for key, amount in bundle.items()
    )


def _saved_order(name: str) -> list[BundleInfo] | None:
    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(name, namespace=_KV_NAMESPACE)
    if raw is None:
        return None
    return [BundleInfo(*row) for row in json.loads(raw)]


def _save_order(name: str, bundles: list[BundleInfo]) -> None:
    from ray.experimental import internal_kv

    rows = [[b.index, b.node_ip, b.gpu_id] for b in bundles]
    internal_kv._internal_kv_put(name, json.dumps(rows), overwrite=True, namespace=_KV_NAMESPACE)


def create_placement(
    cfg: ClusterConfig, name: str | None = None, timeout_s: float = 120.0
) -> Placement:
    """Reserve (or find, by `name`) the run's placement group and order its bundles.

    Needs a connected Ray driver. Fails with the missing resources in the message if the
    cluster cannot hold the bundles within `timeout_s` (and withdraws the request, so it
    does not grab resources later), instead of waiting forever.
    """
    import ray
    from ray.util import get_placement_group, placement_group, remove_placement_group

    plan = plan_resources(cfg)
    use_gpu = cluster_has_gpus()
    bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpu else {"CPU": 1.0}
    pg = None
    if name is not None:
        try:
            pg = get_placement_group(name)
        except ValueError:
            pg = None
    if pg is not None and len(pg.bundle_specs) != plan.num_bundles:
        raise ConfigError(
            f"placement group {name!r} has {len(pg.bundle_specs)} bundles but the cluster "
            f"section asks for {plan.num_bundles}; remove it or use another run name"
        )
    created = pg is None
    if pg is None:
        if cfg.address is None:
            _check_fits_local_head(plan, bundle)
        options: dict[str, Any] = {"strategy": "PACK"}
        if name is not None:
            options.update(name=name, lifetime="detached")
        pg = placement_group([dict(bundle) for _ in range(plan.num_bundles)], **options)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        missing = _missing_resources(plan.num_bundles, bundle)
        if created:
            remove_placement_group(pg)
        raise RuntimeError(
            f"placement group {name or pg.id.hex()} of {plan.num_bundles} x {bundle} bundles "
            f"could not be placed within {timeout_s:.0f}s ({missing}); other runs' placement "
            "groups or actors hold the rest (`rollflow cluster status`), or set "
            "cluster.placement=never"
        )
    bundles = _saved_order(name) if name is not None and not created else None
    if bundles is None:
        bundles = order_bundles(probe_bundles(pg, plan.num_bundles, use_gpu))
        if name is not None:
            _save_order(name, bundles)
    return Placement(pg, plan, bundles, use_gpu)


def remove_named_placement(name: str) -> bool:
    """Remove the placement group `name` and its saved bundle order; False if none."""
    from ray.experimental import internal_kv
    from ray.util import get_placement_group, remove_placement_group

    internal_kv._internal_kv_del(name, namespace=_KV_NAMESPACE)
    try:
        remove_placement_group(get_placement_group(name))
    except ValueError:
        return False
    return True


def actor_bundle(actor: Any) -> tuple[str, int] | None:
    """(placement group id, bundle index) an actor was scheduled into, None if unpinned.

    Read from the GCS actor table (the resources it reserved are named
    `bundle_group_{index}_{pg id}`): `ray.util.state` would need the dashboard, which the
    local heads rollflow starts do not run.
    """
    import importlib

    from ray._private.state import state

    accessor: Any = state._global_state_accessor
    table: Any = importlib.import_module("ray.core.generated.gcs_pb2").ActorTableData
    info = table.FromString(accessor.get_actor_info(actor._actor_id))
    pg_id = info.placement_group_id.hex()
    if not pg_id:
        return None
    prefix, suffix = "bundle_group_", f"_{pg_id}"
    for key in info.required_resources:
        middle = key[len(prefix) : -len(suffix)]
        if key.startswith(prefix) and key.endswith(suffix) and middle.isdigit():
            return pg_id, int(middle)
    return pg_id, -1
