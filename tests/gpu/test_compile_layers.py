"""`train.compile_layers` on a GPU: decoder layers run through torch.compile (dynamic shapes)
give the eager layers' log-probs and gradients, float32 within float rounding and bf16 within
bf16's, over micro-batches of three shapes (one compile for all of them). 4 layers of
bench.megatron_grpo's 0.5B Qwen2 shape, random weights, padded rows without their mask
(`train.flash_attention`). The speed: bench/megatron_grpo.py --compile-layers."""

from __future__ import annotations

import pytest
import torch

from engines.train.batching import build_padded_batch
from engines.train.torch_models import compile_layers
from tests.gpu.test_flash_attention import _model, _run, _samples

pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize(("dtype", "tolerance", "grad_rel"), [
    (torch.float32, 1e-4, 1e-4),
    (torch.bfloat16, 0.1, 0.02),
])
def test_compiled_layers_equal_the_eager_ones(
        dtype: torch.dtype, tolerance: float, grad_rel: float) -> None:
    device = torch.device("cuda", 0)
    eager, compiled = _model(device), _model(device)
    compile_layers(compiled)
    samples = _samples()
    for rows in (samples[:2], samples[2:4], samples[4:]):
        batch = build_padded_batch(rows).to(device)
        want, want_grad = _run(eager, batch, dtype, flash=True)
        got, grad = _run(compiled, batch, dtype, flash=True)
        diff = float((got - want).abs().max())
        rel = float((grad - want_grad).norm() / want_grad.norm())
        print(f"{dtype} {tuple(batch.input_ids.shape)}: log-prob max diff {diff:.2e}, "
              f"q_proj grad rel diff {rel:.2e}")
        assert diff <= tolerance and rel <= grad_rel, (diff, rel)
