"""FSDP2 (`train.strategy: fsdp2`) trains what DDP trains: two gloo ranks take two GRPO steps
of the torch trainer on the session's tiny model under each strategy, in float32, and the
losses, gradient norms, log-probs after each step and final weights agree within 1e-5.

The batch gives the ranks different numbers of micro-batches, so the FSDP2 ranks must pad
with uncounted stand-ins; without that the rank with fewer forwards leaves the other waiting
in a gather, and the test fails at the group's 60 s timeout.

The FSDP2 checkpoint (HF weights, the optimizer state as DCP shards) then resumes on one
rank, resharded, and its next step matches the two ranks' own next step; a DDP trainer
refuses it in one line."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support import fsdp_runs as runs
from tests.support.rendezvous import file_rendezvous


def _rank(rank: int, init: str, model_dir: str, out: str) -> None:
    # a rank left waiting in a collective fails in 60 s instead of hanging the test
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    out_dir = Path(out)
    try:
        for strategy in ("ddp", "fsdp2"):
            trainer = runs.backend(model_dir, strategy)
            counts = runs.count_micro_batches(trainer)
            record = runs.train(trainer, range(2))
            record["micro_batches"] = counts
            weights = trainer.export_weights()  # a collective under fsdp2
            if strategy == "fsdp2":
                trainer.save_checkpoint(str(out_dir / "ckpt"))
                after = runs.train(trainer, range(2, 3))
                step2 = trainer.export_weights()
                if rank == 0:
                    runs.save(out_dir / "fsdp2-step2", after, step2)
            runs.save(out_dir / f"{strategy}-rank{rank}", record, weights)
    finally:
        dist.destroy_process_group()


def _resume_on_one_rank(_: int, init: str, model_dir: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        ckpt = str(Path(out) / "ckpt")
        refused = ""
        try:
            runs.backend(model_dir, "ddp", load=ckpt)  # on a group of one rank: unwrapped
        except ValueError as exc:
            refused = str(exc)
        trainer = runs.backend(model_dir, "fsdp2", load=ckpt)
        record = runs.train(trainer, range(2, 3))
        record["version"] = trainer.version
        record["refused"] = refused
        runs.save(Path(out) / "resumed", record, trainer.export_weights())
    finally:
        dist.destroy_process_group()


def test_fsdp2_trains_as_ddp_and_resumes_resharded(tiny_model_dir: str, tmp_path: Path) -> None:
    mp.spawn(_rank, args=(file_rendezvous(tmp_path), tiny_model_dir, str(tmp_path)), nprocs=2)
    ddp, ddp_weights = runs.load(tmp_path / "ddp-rank0")
    for rank in (0, 1):
        fsdp2, weights = runs.load(tmp_path / f"fsdp2-rank{rank}")
        runs.assert_close(ddp, fsdp2)
        runs.assert_same_weights(ddp_weights, weights)  # every rank exports them whole
    counts = [runs.load(tmp_path / f"fsdp2-rank{r}")[0]["micro_batches"] for r in (0, 1)]
    assert counts[0] != counts[1], f"the ranks' micro-batch counts are even: {counts}"
    initial = runs.initial_weights(tiny_model_dir)
    assert any(not torch.equal(ddp_weights[n], initial[n]) for n in initial), "nothing trained"

    ckpt = tmp_path / "ckpt"
    assert (ckpt / "optimizer_dcp" / ".metadata").exists() and not (ckpt / "optimizer.pt").exists()
    mp.spawn(_resume_on_one_rank, args=(file_rendezvous(tmp_path), tiny_model_dir,
                                        str(tmp_path)), nprocs=1)
    resumed, resumed_weights = runs.load(tmp_path / "resumed")
    both, both_weights = runs.load(tmp_path / "fsdp2-step2")
    assert resumed["version"] == 3
    runs.assert_close(both, resumed)
    runs.assert_same_weights(both_weights, resumed_weights)
    assert "optimizer state as FSDP2 shards" in resumed["refused"]
