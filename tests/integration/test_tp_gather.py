"""`parallel.gather_tp` on the CPU: two gloo TP ranks, each holding `shard_tp`'s slice of one
state dict, each get the full state back (`merge_tp`'s layout: fc1's gate/up halves, column-
and row-parallel splits, replicated norms) as host copies, not views of their own shards."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engines.train.megatron.hf_convert import shard_tp
from engines.train.megatron.parallel import gather_tp
from tests.support.rendezvous import file_rendezvous

LAYER = "decoder.layers.0."


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {
        "embedding.word_embeddings.weight": (8, 4),
        LAYER + "self_attention.linear_qkv.weight": (12, 4),
        LAYER + "self_attention.linear_qkv.bias": (12,),
        LAYER + "self_attention.linear_proj.weight": (4, 4),
        LAYER + "mlp.linear_fc1.weight": (16, 4),
        LAYER + "mlp.linear_fc2.weight": (4, 8),
        LAYER + "self_attention.linear_qkv.layer_norm_weight": (4,),
        "decoder.final_layernorm.weight": (4,),
    }
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def _rank(rank: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank,
                            world_size=2)
    try:
        local = shard_tp(full_state(), rank, 2)
        full = gather_tp(local, None, 2)
        for name, tensor in full.items():  # a copy: writing it leaves the rank's shard alone
            assert tensor.data_ptr() != local[name].data_ptr(), name
        torch.save(full, os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_the_full_state(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(file_rendezvous(tmp_path), str(tmp_path)), nprocs=2, join=True)
    expected = full_state()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (rank, name)
