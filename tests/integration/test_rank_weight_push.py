"""Colocated tensor sync in slime's layout, on the CPU: two gloo train ranks, each a real
`TrainActor` whose export is marked with its rank, push to engines that record what they
get. With one rank per engine GPU (one engine of TP 2, or two engines of TP 1) engine i's
entry j comes from train rank i * TP + j, over every bucket; elsewhere (not colocated, or
more ranks than engine GPUs) rank 0's payload is every TP rank's entry and rank 1 sends
nothing. The CUDA IPC version (each entry's handle on its rank's GPU) is
tests/gpu/test_cuda_ipc_ranks.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from engines.train.train_actor import TrainActor
from engines.weights.sync import decode_named_tensors
from tests.support.fakes import ExportingBackend
from tests.support.rank_push import push_from_two_ranks

# (cluster.colocate, cluster.rollout_num_gpus_per_engine, engines, whether each rank sends
# its own entries, the train rank whose payload is each engine's entry j)
CASES = [
    (True, 2, 1, True, [[0, 1]]),
    (True, 1, 2, True, [[0], [1]]),
    (False, 2, 1, False, [[0, 0]]),
    (True, 1, 1, False, [[0]]),
]


def _rank(rank: int, init: str, cfgs: list[Any], urls: list[list[str]], out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank,
                            world_size=2)
    try:
        results = []
        for cfg, engine_urls in zip(cfgs, urls, strict=True):
            trainer = TrainActor(cfg, rank, 2)
            trainer.backend = ExportingBackend(fill=float(rank), names=("a", "b"))
            try:
                versions = trainer.push_weights(engine_urls)
            finally:
                trainer.close_weight_sender()
            results.append({"versions": versions, "timings": sorted(trainer.push_timings())})
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _marker(entry: str, name: str) -> int:
    [(got, tensor)] = decode_named_tensors(entry)
    assert got == name
    return int(tensor[0])


@pytest.mark.timeout(180)
def test_each_engine_tp_rank_gets_the_entry_of_the_train_rank_on_its_gpu(tmp_path: Path) -> None:
    engines = push_from_two_ranks(tmp_path, _rank, [case[:3] for case in CASES])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for i, ((colocate, tp, _, per_rank, expected), case) in enumerate(
            zip(CASES, engines, strict=True)):
        assert results[0][i]["versions"] == [3] * len(case) and results[1][i]["versions"] == []
        assert ("gather_s" in results[0][i]["timings"]) == per_rank, (colocate, tp)
        for engine, ranks in zip(case, expected, strict=True):
            updates = engine.tensor_updates
            assert [u["weight_version"] for u in updates] == ["3", "3"]  # one per bucket
            got = [[_marker(e, name) for e in u["serialized_named_tensors"]]
                   for u, name in zip(updates, ("a", "b"), strict=True)]
            assert got == [ranks, ranks], (colocate, tp, len(case))
