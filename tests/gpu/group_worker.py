"""One rank of a megatron train group without Ray, launched by `test_megatron_group.py`:

    torchrun --nproc-per-node 2 -m tests.gpu.group_worker RUNS_ROOT MODEL_DIR ENGINE_URL OUT

Each rank is a real `TrainActor` (what a Ray train group holds) with a TP=2 megatron
backend, and calls what the group calls on every rank: weights, train_step, push_weights,
save_checkpoint, then ensure_version on fresh actors (which load that checkpoint).
Rank 0 writes OUT/result.json and OUT/weights_{0,1,restored}.pt.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from tests.support.gpu import group_config, write_step


def main() -> None:
    from engines.train.train_actor import TrainActor

    runs_root, model_dir, url, out = sys.argv[1:5]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    cfg = group_config(runs_root, model_dir, "tp2-torchrun", "distributed")
    if rank == 0:
        write_step(cfg)
    dist.barrier()
    actor = TrainActor(cfg, rank, world)
    actor.join_group("", 0)  # the process group exists: only builds the backend
    w0 = actor.weights()
    metrics = actor.train_step(0)
    w1 = actor.weights()
    versions = actor.push_weights([url])
    uri = actor.save_checkpoint(0)  # every rank's shards, stored once (one disk)
    restored = TrainActor(cfg, rank, world)
    restored.join_group("", 0)
    rebuilt = restored.ensure_version(1)  # a fresh backend: loads the checkpoint, no replay
    w_restored = restored.weights()
    if rank == 0:
        actor.close_weight_sender()
        torch.save(w0, os.path.join(out, "weights_0.pt"))
        torch.save(w1, os.path.join(out, "weights_1.pt"))
        torch.save(w_restored, os.path.join(out, "weights_restored.pt"))
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump({"loss": metrics["loss"], "versions": versions, "checkpoint": uri,
                       "rebuilt": rebuilt}, f)
    else:
        assert w0 == {} and w1 == {} and versions == [], "rank 1 must hand back nothing"
        assert uri == "" and w_restored == {}
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
