"""Placement: the resource plan and bundle ordering (pure; real placement groups:
tests/integration/test_placement.py)."""

from __future__ import annotations

import pytest

from engines.cluster.placement import BundleInfo, order_bundles, plan_resources
from flows.config.run import ClusterConfig, ConfigError


def test_plan_disaggregated_and_colocated():
    split = plan_resources(ClusterConfig(
        actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=6,
        rollout_num_gpus_per_engine=2))
    assert (split.num_bundles, split.rollout_offset, split.num_engines) == (14, 8, 3)
    shared = plan_resources(ClusterConfig(actor_num_gpus_per_node=4, colocate=True))
    assert (shared.num_bundles, shared.rollout_offset, shared.num_rollout) == (4, 0, 4)
    default = plan_resources(ClusterConfig(rollout_num_gpus_per_engine=2))
    assert (default.num_bundles, default.num_engines) == (3, 1)


@pytest.mark.parametrize(("fields", "key"), [
    ({"rollout_num_gpus": 3, "rollout_num_gpus_per_engine": 2}, "rollout_num_gpus_per_engine"),
    ({"colocate": True, "rollout_num_gpus": 2, "actor_num_gpus_per_node": 4}, "colocate"),
])
def test_plan_rejects_inconsistent_resources(fields, key):
    with pytest.raises(ConfigError, match=f"cluster.{key}"):
        plan_resources(ClusterConfig(**fields))


def test_order_is_numeric_by_ip_then_gpu():
    infos = [BundleInfo(0, "10.0.0.10", 1), BundleInfo(1, "10.0.0.9", 1),
             BundleInfo(2, "10.0.0.10", 0), BundleInfo(3, "10.0.0.9", 0)]
    assert [b.index for b in order_bundles(infos)] == [3, 1, 2, 0]


def test_engine_gpus_are_consecutive_gpus_of_one_node():
    from engines.cluster.placement import Placement

    cluster = ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4,
                            rollout_num_gpus_per_engine=2)
    bundles = order_bundles([BundleInfo(i, "10.0.0.1", i) for i in range(4)]
                            + [BundleInfo(4, "10.0.0.2", 0), BundleInfo(5, "10.0.0.2", 1)])
    placed = Placement(pg=None, plan=plan_resources(cluster), bundles=bundles, use_gpu=True)
    assert placed.engine_gpus(0) == [2, 3]  # after the two train GPUs of node 1
    assert placed.engine_gpus(1) == [0, 1]  # node 2
    split = order_bundles([BundleInfo(i, "10.0.0.1", i) for i in range(3)]
                          + [BundleInfo(3, "10.0.0.2", 0), BundleInfo(4, "10.0.0.2", 1),
                             BundleInfo(5, "10.0.0.2", 2)])
    across = Placement(pg=None, plan=plan_resources(cluster), bundles=split, use_gpu=True)
    with pytest.raises(ConfigError, match="rollout_num_gpus_per_engine=2 consecutive GPUs"):
        across.engine_gpus(0)  # GPU 2 of node 1 and GPU 0 of node 2
