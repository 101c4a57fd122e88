"""Rollout steps with a two-rank torch trainer (gloo, mock engine): data parallel under DDP
and under FSDP2, and one context-parallel pair (`train.context_parallel=2`: both ranks
split the same samples' sequences). The step tasks drive the group through their usual
`trainer.<method>.remote(...)` calls, the engine ends with the trainer's weights (FSDP2
gathers them from both ranks), and a rank lost between runs takes the group down and the
rerun rebuilds it from the checkpoint (FSDP2: its sharded optimizer state)."""

from __future__ import annotations

import os
import uuid

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from engines.cluster.actors import kill_run_actors, rank_names
from engines.cluster.registry import actor_name, get_run_actor
from storage.run_layout import RunLayout


@pytest.mark.parametrize(("strategy", "context_parallel"),
                         [("ddp", 1), ("fsdp2", 1), ("ddp", 2)], ids=["ddp", "fsdp2", "ddp-cp2"])
def test_steps_with_two_train_ranks_and_a_lost_rank(
    prefect_api, make_config, strategy: str, context_parallel: int
):
    from flows.train import train

    def config(num_rollout: int):
        return make_config(run, "train.backend=torch", "cluster.actor_num_gpus_per_node=2",
                           "cluster.keep_actors=true", "train.save_interval=1",
                           f"train.strategy={strategy}", f"rollout.num_rollout={num_rollout}",
                           f"train.context_parallel={context_parallel}",
                           unique=False)

    run = f"dp-{uuid.uuid4().hex[:8]}"
    cfg = config(2)
    names = rank_names(cfg)
    assert names == [actor_name(cfg, "trainer-rank0"), actor_name(cfg, "trainer-rank1")]
    try:
        train(cfg)
        layout = RunLayout.open(cfg.storage.uri, run)
        assert layout.committed_steps() == [0, 1] and layout.latest_checkpoint() == 1
        assert all("train/loss" in layout.step_metrics(k) for k in (0, 1))
        ranks = [ray.get_actor(n, namespace=cfg.cluster.namespace) for n in names]
        assert ray.get([r.version.remote() for r in ranks]) == [2, 2]
        engine = get_run_actor(cfg.cluster.namespace, run, "engine-0")
        assert ray.get(engine.weight_version.remote()) == 2
        # every rank joins the export (FSDP2 gathers the shards): the checkpoint's weights
        weights = ray.get([r.weights.remote() for r in ranks])[0]
        assert weights, "rank 0 exported no weights"
        checkpoint = os.path.join(layout.uri, "checkpoints", "000001")
        optimizer = {"ddp": "optimizer.pt", "fsdp2": "optimizer_dcp"}[strategy]
        assert os.path.exists(os.path.join(checkpoint, optimizer)), os.listdir(checkpoint)
        saved = AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()
        assert sorted(weights) == sorted(saved)
        assert all(torch.equal(weights[k], saved[k]) for k in saved)

        ray.kill(ranks[1])  # a lost rank: the rerun must rebuild the whole group
        result = train(config(3))
        assert result["restored"] == {"rebuilt": True, "version": 2, "replayed": [],
                                      "unrecorded": [], "inexact": []}
        assert layout.committed_steps() == [0, 1, 2]
        ranks = [ray.get_actor(n, namespace=cfg.cluster.namespace) for n in names]
        assert ray.get([r.version.remote() for r in ranks]) == [3, 3]
    finally:
        kill_run_actors(cfg)
