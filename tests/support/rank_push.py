"""Two spawned train ranks pushing weights to recording engines, one layout per case: the
set-up the CPU (gloo) and GPU (NCCL) per-rank push tests share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from tests.support.configs import small_config
from tests.support.fakes import RecordingEngine
from tests.support.rendezvous import file_rendezvous

RankMain = Callable[[int, str, list[Any], list[list[str]], str], None]
"""(rank, rendezvous init_method, each case's config, each case's engine URLs, output dir),
run per rank."""


def push_from_two_ranks(
    tmp_path: Path, rank_main: RankMain, cases: Sequence[tuple[bool, int, int]]
) -> list[list[RecordingEngine]]:
    """For each (cluster.colocate, cluster.rollout_num_gpus_per_engine, engines) case: a
    config with a bucket per tensor and that many recording engines; `rank_main` runs on 2
    spawned ranks over all of them. Returns each case's engines, closed, with what they got."""
    cfgs, engines = [], []
    for colocate, tp, num_engines in cases:
        cfgs.append(small_config(f"storage.uri={tmp_path / 'runs'}", f"cluster.colocate={colocate}",
                                 f"cluster.rollout_num_gpus_per_engine={tp}",
                                 "train.update_weight_buffer_size=8"))  # a bucket per tensor
        engines.append([RecordingEngine() for _ in range(num_engines)])
    try:
        urls = [[e.url for e in case] for case in engines]
        mp.spawn(rank_main, args=(file_rendezvous(tmp_path), cfgs, urls, str(tmp_path)),
                 nprocs=2, join=True)
    finally:
        for case in engines:
            for engine in case:
                engine.close()
    return engines
