"""`train.chunked_lm_head` on a GPU: one long sequence of the 0.5B Qwen2 shape (random weights,
8 layers, activation checkpointing), the policy loss's forward and backward with the LM head
whole and in chunks. The chunks give the same log-probs and loss (float32: within 1e-4;
bf16: within bf16's rounding of the logits) for less memory: the `[tokens, vocab]` logits and
their gradient are never held whole. Its CPU checks: tests/unit/test_chunked_head.py; memory
and MFU of whole steps: bench/megatron_grpo.py --chunked-lm-head."""

from __future__ import annotations

import pytest
import torch

from bench import context_parallel as cp
from engines.train.torch_models import checkpoint_activations

pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize(("dtype", "length", "tolerance", "compare_memory"), [
    # float32 at 4k: the peak is not the head's (5.56 GiB either way on an H200), so only
    # the values are compared
    (torch.float32, 4096, 1e-4, False),
    (torch.bfloat16, 16384, 0.15, True),
])
def test_chunked_head_equals_the_whole_head_in_less_memory(
        dtype: torch.dtype, length: int, tolerance: float, compare_memory: bool) -> None:
    device = torch.device("cuda", 0)
    model = cp.build_model(8, length, device)
    checkpoint_activations(model)
    batch = cp.long_batch(length, 1024, model.config.vocab_size).to(device)
    whole = cp.loss_step(model, batch, dtype, None, chunked_head=False)
    chunked = cp.loss_step(model, batch, dtype, None, chunked_head=True)
    assert not whole.get("oom") and not chunked.get("oom")
    diff = (chunked["log_probs"] - whole["log_probs"]).abs()
    assert float(diff.max()) <= tolerance, float(diff.max())
    assert abs(chunked["loss"] - whole["loss"]) <= 1e-4
    # the response's logits (and their gradient) in the compute dtype, less one chunk's
    logits_gib = (length - 1024) * model.config.vocab_size * dtype.itemsize / 2**30
    saved = whole["peak_gib"] - chunked["peak_gib"]
    print(f"{dtype} {length}: peak {whole['peak_gib']:.2f} -> {chunked['peak_gib']:.2f} GiB, "
          f"time {whole['time_s']:.2f} -> {chunked['time_s']:.2f} s, "
          f"log-prob max diff {float(diff.max()):.2e}")
    if compare_memory:
        assert saved >= logits_gib, (saved, logits_gib)
