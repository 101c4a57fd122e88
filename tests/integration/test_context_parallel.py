"""Context parallelism (`train.context_parallel`) computes what one rank computes: two gloo
ranks split every sequence of a batch of a grouped-query Qwen2 model (zigzag chunks,
keys and values gathered each layer), and

- the response log-probs, entropies and the gradients of a loss on them equal the unsplit
  forward's within 1e-5 in float32;
- two GRPO steps of the torch trainer with context_parallel=2, under ddp and under fsdp2
  with activation checkpointing (whose recomputation must split alike) and the chunked LM
  head (`train.chunked_lm_head`, whose gradient reaches FSDP2's unsharded head), give the
  losses, gradient norms, log-probs and weights of the same steps on one rank without a
  process group, within 1e-5.

Rows of different lengths share micro-batches, so the zigzag split pads them and the
right-padded rows' pads sit on both ranks."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engines.train.batching import build_padded_batch
from engines.train.context_parallel import ContextGroup, use_context_parallel
from engines.train.torch_models import response_outputs
from tests.support import fsdp_runs as runs
from tests.support.rendezvous import file_rendezvous
from tests.support.samples import long_samples

SPLIT = {"context_parallel": 2, "max_tokens_per_micro_batch": 160}


def _forward_parity(model_dir: str, group: ContextGroup) -> dict[str, float]:
    """Largest differences of the split forward from the unsplit one on this rank."""
    from transformers import AutoModelForCausalLM

    batch = build_padded_batch(long_samples(groups=3, per_group=3, seed=5), 0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    mask = batch.response_mask
    diffs: dict[str, float] = {}
    outs = []
    for context in (None, group):
        if context is not None:
            use_context_parallel(model)
        model.zero_grad()
        log_probs, entropy, _ = response_outputs(model, batch, 0.8, entropy_grad=True,
                                                 context=context)
        ((log_probs + 0.1 * entropy) * batch.loss_mask).sum().backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if context is not None:  # each rank holds its tokens' share of the gradient
            for g in grads.values():
                dist.all_reduce(g)
        outs.append((log_probs.detach() * mask, entropy.detach() * mask, grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = outs
    diffs["log_probs"] = float((lp0 - lp1).abs().max())
    diffs["entropy"] = float((ent0 - ent1).abs().max())
    diffs["grads"] = max(float((g0[n] - g1[n]).abs().max()) for n in g0)
    diffs["grad_scale"] = max(float(g.abs().max()) for g in g0.values())
    return diffs


def _rank(rank: int, init: str, model_dir: str, out: str) -> None:
    out_dir = Path(out)
    if rank == 0:  # the reference: one rank, no process group
        trainer = runs.backend(model_dir, "ddp", **SPLIT | {"context_parallel": 1})
        record = runs.train(trainer, range(2), _batch)
        runs.save(out_dir / "one-rank", record, trainer.export_weights())
    # a rank left waiting in a collective fails in 60 s instead of hanging the test
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        group = ContextGroup.build(2)
        assert group is not None
        (out_dir / f"forward-rank{rank}.json").write_text(
            json.dumps(_forward_parity(model_dir, group)))
        for strategy, extra in (("ddp", {}), ("fsdp2", {"activation_checkpointing": True,
                                                         "chunked_lm_head": True})):
            trainer = runs.backend(model_dir, strategy, **SPLIT, **extra)
            record = runs.train(trainer, range(2), _batch)
            runs.save(out_dir / f"{strategy}-rank{rank}", record, trainer.export_weights())
    finally:
        dist.destroy_process_group()


def _batch(step: int) -> list[Any]:
    return long_samples(groups=3, per_group=3, seed=step)


def test_context_parallel_equals_one_rank(gqa_model_dir: str, tmp_path: Path) -> None:
    mp.spawn(_rank, args=(file_rendezvous(tmp_path), gqa_model_dir, str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        diffs = json.loads((tmp_path / f"forward-rank{rank}.json").read_text())
        assert diffs["grad_scale"] > 1e-2, diffs  # a gradient worth comparing
        assert max(diffs["log_probs"], diffs["entropy"], diffs["grads"]) <= runs.TOL, diffs
    one, one_weights = runs.load(tmp_path / "one-rank")
    initial = runs.initial_weights(gqa_model_dir)
    assert any(not torch.equal(one_weights[n], initial[n]) for n in initial), "nothing trained"
    for strategy in ("ddp", "fsdp2"):
        for rank in (0, 1):
            split, weights = runs.load(tmp_path / f"{strategy}-rank{rank}")
            runs.assert_close(one, split)
            runs.assert_same_weights(one_weights, weights)


@pytest.fixture(scope="module")
def gqa_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Qwen2 with grouped-query attention (4 query heads, 2 key/value heads) and
    room for the long samples' positions."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=80, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         max_position_embeddings=256, tie_word_embeddings=False,
                         pad_token_id=0)
    out = str(tmp_path_factory.mktemp("gqa-model"))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out
