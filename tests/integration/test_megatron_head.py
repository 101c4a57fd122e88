"""Token statistics over a vocabulary split across two torch.distributed (gloo) ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from engines.train.token_stats import token_stats
from tests.support.rendezvous import file_rendezvous
from tests.support.samples import HEAD_VOCAB, reference_token_stats, weighted_grads


def _tp_rank(rank: int, init: str, logits: Tensor, targets: Tensor, w: Tensor, out: Any) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        half = HEAD_VOCAB // 2
        shard = logits[..., rank * half:(rank + 1) * half].clone().requires_grad_(True)
        lp, h = token_stats(shard, targets, 0.9, dist.group.WORLD, rank * half)
        ((lp + h) * w).sum().backward()
        out[rank] = (lp.detach(), h.detach(), shard.grad)
    finally:
        dist.destroy_process_group()


def test_token_stats_over_a_vocab_split_in_two(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, HEAD_VOCAB, generator=gen) * 2
    targets = torch.randint(0, HEAD_VOCAB, (3, 5), generator=gen)
    w = torch.randn(3, 5, generator=gen)
    out = mp.Manager().dict()
    mp.spawn(_tp_rank, args=(file_rendezvous(tmp_path), logits, targets, w, out), nprocs=2,
             join=True)
    lp, h, grad = weighted_grads(logits, lambda x: reference_token_stats(x, targets, 0.9), w, w)
    for rank in (0, 1):
        torch.testing.assert_close(out[rank][0], lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[rank][1], h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([out[0][2], out[1][2]], dim=-1), grad, atol=1e-5, rtol=1e-5)
