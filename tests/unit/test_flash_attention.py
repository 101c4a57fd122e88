"""`train.flash_attention`: padded rows without their padding mask and one varlen-packed row
(on the CPU and in float32: causal SDPA a sequence at a time) give the masked padded rows'
log-probs and gradients, and train the same through the torch backend. The flash varlen
kernel itself: tests/gpu/test_flash_attention.py."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.train.batching import build_padded_batch
from engines.train.flash_attention import ATTENTION_NAME, attention_mask_for, use_flash_attention
from engines.train.packing import build_packed_batch
from engines.train.torch_models import response_log_probs
from tests.support.samples import TOL, assert_trains_the_same, grouped_samples


def test_each_layout_gives_the_masked_rows_values_and_gradients(tiny_model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    use_flash_attention(model)
    assert model.config._attn_implementation == ATTENTION_NAME
    samples = grouped_samples(groups=3, per_group=4)
    padded = build_padded_batch(samples, 0)
    assert attention_mask_for(padded, keep_padding_mask=False) is None
    assert attention_mask_for(padded, keep_padding_mask=True) is padded.attention_mask
    packed = functools.partial(build_packed_batch, share_prompts=False, varlen=True)(samples)
    results = []
    for batch, flash in ((padded, False), (padded, True), (packed, True)):
        model.zero_grad()
        lp, ent = response_log_probs(model, batch, 0.8, entropy_grad=True, flash=flash)
        mask = batch.loss_mask
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp[mask.bool()], ent[mask.bool()], grads))
    lp0, ent0, g0 = results[0]
    for lp, ent, g in results[1:]:
        torch.testing.assert_close(lp, lp0, atol=TOL, rtol=0)
        torch.testing.assert_close(ent, ent0, atol=TOL, rtol=0)
        assert g.keys() == g0.keys()
        for name in g0:
            torch.testing.assert_close(g[name], g0[name], atol=TOL, rtol=1e-4, msg=name)


@pytest.mark.parametrize("pack", [False, True])
def test_backend_trains_the_same_with_flash_attention(tiny_model_dir: str, pack: bool) -> None:
    """Two optimizer steps from one start: the same metrics and weights with and without."""
    common = {"max_tokens_per_micro_batch": 40, "pack_sequences": pack, "share_prompts": False}
    _, flash = assert_trains_the_same(tiny_model_dir, {"flash_attention": False},
                                      {"flash_attention": True}, **common)
    assert flash.model.config._attn_implementation == ATTENTION_NAME


def test_packed_rows_stay_masked_on_a_model_built_without_it(tiny_model_dir: str) -> None:
    """A replay may turn flash_attention on for a trainer built with it off: its model has
    transformers' own attention, which would ignore the varlen boundaries."""
    from engines.train.step_settings import StepSettings
    from tests.support.samples import make_backend

    backend = make_backend(tiny_model_dir, pack_sequences=True, share_prompts=False,
                           flash_attention=False)
    cfg = backend.train_cfg.model_copy(update={"flash_attention": True})
    backend.use_settings(StepSettings(train=cfg, algorithm=backend.algo_cfg,
                                      temperature=1.0, reward_key=None))
    batch = backend._log_prob_batch(backend.model)(grouped_samples(groups=2, per_group=2), 0)
    assert batch.cu_seqlens is None and batch.attention_mask.dim() == 4
