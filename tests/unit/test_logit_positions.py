"""The LM head runs on the response-predicting positions only (`batching.logit_positions`):
the same log-probs, entropies and gradients as projecting every position."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.algorithms.losses import entropy_from_logits
from engines.train.batching import (
    PaddedBatch,
    build_padded_batch,
    gather_response_logits,
    log_probs_from_logits,
    logit_positions,
)
from engines.train.packing import build_packed_batch
from engines.train.prompt_sharing import build_shared_prompt_batch
from engines.train.torch_models import response_log_probs, trims_logits
from storage.sample import Sample
from tests.support.samples import TOL, grouped_samples


def test_positions_by_hand() -> None:
    a = Sample(index=0, group_index=0, tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1, 1])
    b = Sample(index=1, group_index=0, tokens=[9, 10, 11], response_length=1, loss_mask=[1])
    batch = build_padded_batch([a, b], pad_token_id=0)
    keep, index = logit_positions(batch)
    # a needs positions 1, 2; b needs 1 (its padded slot reads some kept position)
    assert keep[0].tolist() == [1, 2] and keep[1, 0].item() == 1
    assert index[0].tolist() == [0, 1] and index[1, 0].item() == 0


def _full(model: torch.nn.Module, batch: PaddedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False)
    logits = gather_response_logits(out.logits, batch.logit_index, batch.logit_row).float()
    logits = logits / 0.8
    return log_probs_from_logits(logits, batch.targets), entropy_from_logits(logits)


@pytest.mark.parametrize("layout", ["padded", "shared", "packed"])
def test_trimmed_head_matches_the_full_one(tiny_model_dir: str, layout: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert trims_logits(model)
    samples = grouped_samples(groups=3, per_group=4, seed=2)
    build = {"padded": build_padded_batch, "shared": build_shared_prompt_batch,
             "packed": build_packed_batch}[layout]
    batch = build(samples, 0)
    results = []
    for trimmed in (False, True):
        model.zero_grad()
        if trimmed:
            lp, ent = response_log_probs(model, batch, temperature=0.8, entropy_grad=True)
        else:
            lp, ent = _full(model, batch)
        ((lp + ent) * batch.loss_mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        mask = batch.response_mask.bool()
        results.append((lp[mask], ent[mask], grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=TOL, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=TOL, rtol=0)
    torch.testing.assert_close(g1, g0, atol=TOL, rtol=1e-4)
