"""`train.flash_attention` on a GPU: the log-probs and gradients of padded rows without their
padding mask (causal flash SDPA) and of one varlen-packed row (`varlen_attn`, flash varlen in
bf16) equal the masked padded rows' (transformers' sdpa with a 4-D mask): float32 within
float rounding, bf16 within bf16's. 4 layers of bench.megatron_grpo's 0.5B Qwen2 shape,
random weights, 6 samples of different lengths. CPU checks of the same layouts:
tests/unit/test_flash_attention.py; the speed: bench/megatron_grpo.py --flash-attention."""

from __future__ import annotations

import functools

import pytest
import torch

from engines.train.batching import PaddedBatch, build_padded_batch
from engines.train.flash_attention import use_flash_attention
from engines.train.packing import build_packed_batch
from engines.train.torch_models import autocast, response_log_probs
from storage.sample import Sample

pytestmark = [pytest.mark.gpu]


def _samples() -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate([(700, 1500), (700, 900), (300, 2000), (300, 37), (1024, 3072),
                                (1024, 1700)]):
        tokens = torch.randint(0, 151936, (p + r,), generator=gen).tolist()
        out.append(Sample(index=i, group_index=i // 2, tokens=tokens, response_length=r,
                          loss_mask=[1] * r))
    return out


def _model(device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2Config

    from bench.megatron_grpo import QWEN2_05B

    config = Qwen2Config(**{**QWEN2_05B, "num_hidden_layers": 4})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).eval()
    use_flash_attention(model)
    return model


def _run(model: torch.nn.Module, batch: PaddedBatch, dtype: torch.dtype,
         flash: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Response log-probs `[B, R]` and the gradient of their masked sum on the first layer's
    query projection."""
    model.zero_grad(set_to_none=True)
    with autocast(batch.input_ids.device, dtype):
        log_probs, _ = response_log_probs(model, batch, 1.0, flash=flash)
    (log_probs * batch.response_mask).sum().backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad.detach().clone()
    return log_probs.detach() * batch.response_mask, grad


@pytest.mark.parametrize(("dtype", "tolerance", "grad_rel"), [
    (torch.float32, 1e-4, 1e-4),
    (torch.bfloat16, 0.1, 0.02),
])
def test_flash_layouts_equal_the_masked_padded_rows(
        dtype: torch.dtype, tolerance: float, grad_rel: float) -> None:
    device = torch.device("cuda", 0)
    model = _model(device)
    samples = _samples()
    padded = build_padded_batch(samples).to(device)
    packed = functools.partial(build_packed_batch, share_prompts=False, varlen=True)(
        samples).to(device)
    masked, masked_grad = _run(model, padded, dtype, flash=False)
    for name, batch in (("padded, no mask", padded), ("varlen packed", packed)):
        values, grad = _run(model, batch, dtype, flash=True)
        diff = float((values - masked).abs().max())
        rel = float((grad - masked_grad).norm() / masked_grad.norm())
        print(f"{dtype} {name}: log-prob max diff {diff:.2e}, q_proj grad rel diff {rel:.2e}")
        assert diff <= tolerance, (name, diff)
        assert rel <= grad_rel, (name, rel)
