"""Placement: real placement groups on a CPU-only Ray head and on Ray's multi-node test
cluster with fake GPUs and distinct node IPs (the plan itself: tests/unit/test_placement.py).

The multi-node cluster needs its own driver (a process joins one Ray cluster), so that test
runs this module as a script and checks what it prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from engines.cluster.placement import create_placement
from flows.config.run import ClusterConfig
from tests.support import REPO_ROOT


def test_cpu_only_bundles_on_a_head_without_gpus(ray_address):
    import ray

    placement = create_placement(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=1))
    try:
        assert not placement.use_gpu
        assert placement.pg.bundle_specs == [{"CPU": 1.0}] * 3
        assert {b.gpu_id for b in placement.bundles} == {-1}
        assert placement.train_bundles == [0, 1] and placement.rollout_bundles == [2]
        opts = placement.actor_options(placement.rollout_bundles[0], fraction=0.5)
        assert opts["num_cpus"] == 0.5 and "num_gpus" not in opts
        probe = ray.remote(lambda: ray.get_runtime_context().get_placement_group_id())
        assert ray.get(probe.options(**opts).remote()) == placement.pg.id.hex()
    finally:
        placement.remove()


def test_multi_node_cluster_orders_and_splits_bundles():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.test_placement"], cwd=REPO_ROOT, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    node_a, node_b = ["127.0.0.2", 0], ["127.0.0.2", 1]
    node_c, node_d = ["127.0.0.3", 0], ["127.0.0.3", 1]

    split = out["disaggregated"]
    where = {int(k): v for k, v in split["where"].items()}
    # ordered by node IP then GPU id, whatever order Ray created the bundles in
    assert [where[i] for i in split["ordered"]] == [node_a, node_b, node_c, node_d]
    assert split["train"] == split["ordered"][:2] and split["rollout"] == split["ordered"][2:]
    assert split["engine_1"] == split["ordered"][3:]
    # an actor pinned with actor_options runs on its bundle's node and GPU
    assert split["pinned"] == [where[i] for i in split["train"] + split["rollout"]]

    shared = out["colocated"]
    where = {int(k): v for k, v in shared["where"].items()}
    assert [where[i] for i in shared["ordered"]] == [node_a, node_b, node_c, node_d]
    assert shared["train"] == shared["rollout"] == shared["ordered"]
    assert shared["engines"] == [shared["ordered"][:2], shared["ordered"][2:]]


def _run_multi_node_cluster() -> dict:
    """Head without GPUs plus two 2-GPU nodes on 127.0.0.3 and 127.0.0.2 (fake GPUs)."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False})
    for ip in ("127.0.0.3", "127.0.0.2"):
        cluster.add_node(num_cpus=2, num_gpus=2, node_ip_address=ip)
    ray.init(address=cluster.address, log_to_driver=False)

    @ray.remote
    class Where:
        def where(self) -> list:
            return [ray.util.get_node_ip_address(), int(ray.get_gpu_ids()[0])]

    def describe(placement, pin: bool) -> dict:
        result = {
            "where": {b.index: [b.node_ip, b.gpu_id] for b in placement.bundles},
            "ordered": [b.index for b in placement.bundles],
            "train": placement.train_bundles, "rollout": placement.rollout_bundles,
            "engines": [placement.engine_bundles(i) for i in range(placement.plan.num_engines)],
        }
        if pin:
            actors = [Where.options(**placement.actor_options(i, 0.5)).remote()
                      for i in placement.train_bundles + placement.rollout_bundles]
            result["pinned"] = ray.get([a.where.remote() for a in actors])
        return result

    try:
        split = create_placement(ClusterConfig(
            actor_num_gpus_per_node=2, rollout_num_gpus=2), name="split")
        out = {"disaggregated": {**describe(split, True), "engine_1": split.engine_bundles(1)}}
        split.remove()
        shared = create_placement(ClusterConfig(
            actor_num_nodes=2, actor_num_gpus_per_node=2, colocate=True,
            rollout_num_gpus_per_engine=2), name="shared")
        out["colocated"] = describe(shared, False)
        shared.remove()
        return out
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    print(json.dumps(_run_multi_node_cluster()))


