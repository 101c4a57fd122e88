"""Data-parallel ranks split the scoring forwards (old, reference and teacher log-probs):
two gloo ranks, under ddp and under fsdp2, each score only their share of a batch and swap
the results, and every rank ends with the log-probs one process computes alone for the whole
batch (float32, within 1e-5: other micro-batches, other padding). Under fsdp2, whose forwards
are collectives, the ranks run as many forwards each, the one with fewer padding with
stand-ins; with shared prompts (`share_prompts`), a group's samples stay on one rank."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engines.train import torch_backend
from engines.train.distributed import data_shares
from tests.support import fsdp_runs as runs
from tests.support.rendezvous import file_rendezvous

CASES = {"ddp": ("ddp", {}), "fsdp2": ("fsdp2", {}), "ddp-shared": ("ddp", {"share_prompts": True})}


def _rank(rank: int, init: str, model_dir: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    scored: list[int] = []
    real = torch_backend.score_samples

    def counting(samples: list[Any], *args: Any) -> Any:
        # (fn, budget, pad id, device, build, packed, by_group[, forwards]), as _score calls
        batches = torch_backend.scoring_batches(samples, args[1], args[5], args[6])
        scored.extend([len(samples), max(len(batches), *args[7:8])])
        return real(samples, *args)

    torch_backend.score_samples = counting  # type: ignore[assignment]
    try:
        for name, (strategy, train) in CASES.items():
            scored.clear()
            trainer = runs.backend(model_dir, strategy, **train)
            scores = trainer.score("policy", runs.batch(0))
            Path(out, f"{name}-rank{rank}.json").write_text(json.dumps({
                "scores": [t.tolist() for t in scores],
                "samples_scored": scored[0::2], "forwards": scored[1::2]}))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The two ranks, run once for every case."""
    out = tmp_path_factory.mktemp("dp-scoring")
    mp.spawn(_rank, args=(file_rendezvous(out), tiny_model_dir, str(out)), nprocs=2)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_score_their_share_and_get_every_score(
        name: str, tiny_model_dir: str, spawned: Path) -> None:
    out = spawned
    strategy, train = CASES[name]
    alone = runs.backend(tiny_model_dir, "ddp", **train).score("policy", runs.batch(0))
    batch = len(alone)
    records = [json.loads((out / f"{name}-rank{r}.json").read_text()) for r in (0, 1)]
    for record in records:
        assert len(record["scores"]) == batch
        for got, want in zip(record["scores"], alone, strict=True):
            torch.testing.assert_close(torch.tensor(got), want, atol=runs.TOL, rtol=0)
    scored = [sum(r["samples_scored"]) for r in records]
    assert sum(scored) == batch and max(scored) < batch, scored  # each its share, once
    if strategy == "fsdp2":
        assert records[0]["forwards"] == records[1]["forwards"]


def test_shares_are_strided_or_whole_groups() -> None:
    assert data_shares(5, 2) == [[0, 2, 4], [1, 3]]
    assert data_shares(6, 2, [7, 7, 3, 3, 9, 9]) == [[0, 1, 4, 5], [2, 3]]
    assert data_shares(1, 3) == [[0], [], []]

