"""The fused log-prob / entropy on CUDA (`token_stats` through torch.compile) against the
chunked eager path and the unfused formulas, at the Qwen2 vocabulary size, bf16 logits."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from engines.algorithms.losses import entropy_from_logits
from engines.train import token_stats as stats_module
from engines.train.batching import log_probs_from_logits
from engines.train.token_stats import token_stats

pytestmark = pytest.mark.gpu


def _run(logits: torch.Tensor, targets: torch.Tensor, w: torch.Tensor, how: str) -> tuple[torch.Tensor, ...]:
    x = logits.detach().clone().requires_grad_(True)
    if how == "reference":
        z = x.float() / 0.7
        lp, h = log_probs_from_logits(z, targets), entropy_from_logits(z)
    else:
        lp, h = token_stats(x, targets, 0.7)
    ((lp + 0.3 * h) * w).sum().backward()
    assert x.grad is not None
    return lp.detach(), h.detach(), x.grad.float()


@pytest.mark.parametrize("rows", [1, 777])
def test_compiled_matches_eager_and_reference(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab = 151936
    logits = (torch.randn(rows, vocab, device="cuda", generator=gen) * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    w = torch.randn(rows, device="cuda", generator=gen)
    monkeypatch.setenv("ROLLFLOW_COMPILE_TOKEN_STATS", "1")
    stats_module._compiled.clear()
    torch._dynamo.reset()  # compiled afresh by this test, its graphs counted below
    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = _run(logits, targets, w, "fused")
    # a failed compile falls back to the eager path (warned once, the switch turned off), and
    # a disabled one (TORCH_COMPILE_DISABLE) runs it eagerly: the comparison below would then
    # be eager against eager
    fell_back = [str(c.message) for c in caught if "torch.compile failed" in str(c.message)]
    assert not fell_back and os.environ["ROLLFLOW_COMPILE_TOKEN_STATS"] == "1", fell_back
    assert "stats" in stats_module._compiled and "grad" in stats_module._compiled
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])  # forward, backward
    monkeypatch.setenv("ROLLFLOW_COMPILE_TOKEN_STATS", "0")
    eager = _run(logits, targets, w, "fused")
    reference = _run(logits, targets, w, "reference")
    for want in (eager, reference):
        torch.testing.assert_close(compiled[0], want[0], atol=5e-5, rtol=1e-5)  # log-probs
        torch.testing.assert_close(compiled[1], want[1], atol=5e-5, rtol=1e-5)  # entropy
        # bf16 gradients: fp32 results may round to neighbouring bf16 values
        torch.testing.assert_close(compiled[2], want[2], atol=1e-6, rtol=8e-3)
