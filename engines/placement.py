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
instead of reserving the resources twice.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from flows.config import ClusterConfig, ConfigError


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
    num_train = cfg.actor_num_nodes * cfg.actor_num_gpus_per_node
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


class _BundleProbe:
    """Reports where it runs; one per bundle, killed right after."""

    def where(self) -> tuple[str, int]:
        import ray

        gpu_ids = ray.get_gpu_ids()
        return ray.util.get_node_ip_address(), int(gpu_ids[0]) if gpu_ids else -1


def cluster_has_gpus() -> bool:
    import ray

    return float(ray.cluster_resources().get("GPU", 0)) > 0


def probe_bundles(pg: Any, num_bundles: int, use_gpu: bool) -> list[BundleInfo]:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    probe: Any = ray.remote(_BundleProbe)
    resource = {"num_gpus": 0.01, "num_cpus": 0} if use_gpu else {"num_cpus": 0.01}
    actors: list[Any] = [
        probe.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
            **resource,
        ).remote()
        for i in range(num_bundles)
    ]
    try:
        where = ray.get([a.where.remote() for a in actors])
    finally:
        for a in actors:
            ray.kill(a)
    return [BundleInfo(i, ip, gpu) for i, (ip, gpu) in enumerate(where)]


def create_placement(
    cfg: ClusterConfig, name: str | None = None, timeout_s: float = 120.0
) -> Placement:
    """Reserve (or find, by `name`) the run's placement group and order its bundles.

    Needs a connected Ray driver. Fails with the plan in the message if the cluster cannot
    hold the bundles within `timeout_s`, instead of waiting forever.
    """
    import ray
    from ray.util import get_placement_group, placement_group

    plan = plan_resources(cfg)
    use_gpu = cluster_has_gpus()
    bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
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
    if pg is None:
        options: dict[str, Any] = {"strategy": "PACK"}
        if name is not None:
            options.update(name=name, lifetime="detached")
        pg = placement_group([dict(bundle) for _ in range(plan.num_bundles)], **options)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        raise RuntimeError(
            f"placement group of {plan.num_bundles} x {bundle} bundles not ready after "
            f"{timeout_s:.0f}s (cluster resources: {ray.cluster_resources()})"
        )
    return Placement(pg, plan, order_bundles(probe_bundles(pg, plan.num_bundles, use_gpu)), use_gpu)
