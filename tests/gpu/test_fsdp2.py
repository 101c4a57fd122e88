"""FSDP2 on GPUs (NCCL): the torch trainer sharded over every GPU here (max 2) against the
unsharded trainer (DDP on 2 GPUs; on one GPU a plain module, while FSDP2 still shards over
a group of one, so its code path runs: DTensors, gathers, reduce-scatters, DCP).

- float32: FSDP2 trains what DDP trains within 1e-5 (losses, log-probs, weights), with the
  colocated trainer's offload and onload between its steps;
- `train.fsdp_cpu_offload`: the same within 1e-5, its optimizer stepping on the CPU;
- bfloat16 (gathered layers in bf16, float32 master weights and reductions): trains, and its
  log-probs stay near float32's;
- a checkpoint resumes in a fresh backend and takes the same next step.
The CPU version with two gloo ranks and a resharding resume: tests/integration/test_fsdp2.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engines.train.distributed import process_group_backend
from tests.support import fsdp_runs as runs
from tests.support.gpu import NCCL_SAFE_ENV
from tests.support.rendezvous import file_rendezvous

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]  # both GPUs where there are two


def _rank(rank: int, world: int, init: str, model_dir: str, out: str) -> None:
    # deterministic kernels (train.deterministic; cuBLAS then needs a fixed workspace): the
    # order of CUDA's atomic adds (the embedding's backward) cannot then differ between the
    # runs, where Adam's first steps (about lr x the gradient's sign) would magnify it
    os.environ.update(NCCL_SAFE_ENV, LOCAL_RANK=str(rank), CUBLAS_WORKSPACE_CONFIG=":4096:8")
    torch.cuda.set_device(rank)
    # the offload case reduces CPU shards' gradient norm: gloo beside NCCL, as the train
    # group's ranks join with `train.fsdp_cpu_offload` (engines/train/distributed.py)
    backend = process_group_backend(cuda=True, cpu_collectives=True)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    out_dir = Path(out)
    try:
        cases = {"ddp": ("ddp", {}), "fsdp2": ("fsdp2", {}),
                 "fsdp2-offload": ("fsdp2", {"fsdp_cpu_offload": True}),
                 "fsdp2-bf16": ("fsdp2", {"dtype": "bfloat16"})}
        for name, (strategy, train) in cases.items():
            trainer = runs.backend(model_dir, strategy, deterministic=True, **train)
            assert trainer.device.type == "cuda"
            record = runs.train(trainer, range(1))
            if name == "fsdp2":  # colocated: the trainer gives the GPU up between steps
                trainer.offload()
                trainer.onload()
            record2 = runs.train(trainer, range(1, 2))
            for key in record:
                record[key] += record2[key]
            # a copy: on one GPU a gathered tensor is the live parameter, which trains on
            weights = {k: v.detach().clone() for k, v in trainer.export_weights().items()}
            if name == "fsdp2":
                trainer.save_checkpoint(str(out_dir / "ckpt"))
                after = runs.train(trainer, range(2, 3))
                resumed = runs.backend(model_dir, strategy, load=str(out_dir / "ckpt"),
                                       deterministic=True)
                again = runs.train(resumed, range(2, 3))
                if rank == 0:
                    runs.save(out_dir / "step2", after, trainer.export_weights())
                    runs.save(out_dir / "resumed", again, resumed.export_weights())
                else:
                    trainer.export_weights(), resumed.export_weights()
            if rank == 0:
                runs.save(out_dir / name, record, weights)
    finally:
        dist.destroy_process_group()


def test_fsdp2_on_gpus(tiny_model_dir: str, tmp_path: Path) -> None:
    world = min(torch.cuda.device_count(), 2)
    mp.spawn(_rank, args=(world, file_rendezvous(tmp_path), tiny_model_dir, str(tmp_path)),
             nprocs=world)
    ddp, ddp_weights = runs.load(tmp_path / "ddp")
    for name in ("fsdp2", "fsdp2-offload"):
        record, weights = runs.load(tmp_path / name)
        runs.assert_close(ddp, record)
        runs.assert_same_weights(ddp_weights, weights)
    bf16, bf16_weights = runs.load(tmp_path / "fsdp2-bf16")
    assert all(bf16_weights[n].dtype == torch.float32 for n in bf16_weights)  # master weights
    for a, b in zip(ddp["log_probs"][0], bf16["log_probs"][0], strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=0.1, rtol=0)
    initial = runs.initial_weights(tiny_model_dir)
    assert any(not torch.equal(bf16_weights[n], initial[n]) for n in initial), "bf16 trained nothing"
    step2, step2_weights = runs.load(tmp_path / "step2")
    resumed, resumed_weights = runs.load(tmp_path / "resumed")
    runs.assert_close(step2, resumed)
    runs.assert_same_weights(step2_weights, resumed_weights)
