"""The megatron backend's response-only output layer and fused log-prob / entropy
(`response_head`, `token_stats`; pure torch, no megatron needed): the same values and
gradients as projecting every position and the unfused formulas, also with the vocab split
over two (gloo) TP ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from engines.train.batching import build_padded_batch, gather_response_logits, log_probs_from_logits
from engines.train.megatron import token_stats as stats_module
from engines.train.megatron.response_head import response_view, select_positions
from engines.train.megatron.token_stats import token_stats
from engines.train.packing import build_packed_batch
from tests.support.samples import HEAD_VOCAB, grouped_samples, reference_token_stats, weighted_grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_stats_match_the_unfused_formulas(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, temperature: float
) -> None:
    monkeypatch.setattr(stats_module, "CHUNK_BYTES", 4 * HEAD_VOCAB * 5)  # 5 rows a chunk: 3 chunks
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 4, HEAD_VOCAB, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, HEAD_VOCAB, (3, 4), generator=gen)
    w_lp, w_h = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    fused = weighted_grads(logits, lambda x: token_stats(x, targets, temperature), w_lp, w_h)
    plain = weighted_grads(logits, lambda x: reference_token_stats(x, targets, temperature), w_lp, w_h)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert fused[2].dtype == torch.float32 and fused[0].dtype == torch.float32


def test_detached_entropy_gives_the_log_prob_gradient_alone() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, HEAD_VOCAB, generator=gen)
    targets = torch.randint(0, HEAD_VOCAB, (2, 3), generator=gen)
    x = logits.clone().requires_grad_(True)
    lp, h = token_stats(x, targets, entropy_grad=False)
    assert not h.requires_grad
    lp.sum().backward()
    ref = logits.clone().requires_grad_(True)
    log_probs_from_logits(ref, targets).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, atol=1e-6, rtol=1e-5)


class _Head(nn.Module):
    """Called as megatron calls a GPTModel's output layer: `(hidden [s, b, h], weight=...)`."""

    def forward(self, hidden: Tensor, weight: Tensor, runtime_gather_output: Any = None) -> tuple[Tensor, None]:
        return hidden @ weight.T, None


class _ToyGPT(nn.Module):
    """A GPTModel's output convention: hidden `[s, b, h]`, logits returned as `[b, s, V]`."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(HEAD_VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.output_layer = _Head()

    def forward(self, input_ids: Tensor) -> Tensor:
        hidden = torch.tanh(self.mix(self.embedding(input_ids.T)))  # [s, b, h]
        logits, _ = self.output_layer(hidden, weight=self.embedding.weight, runtime_gather_output=None)
        return logits.transpose(0, 1).contiguous()


class _Wrapper(nn.Module):  # megatron's DDP keeps the model as `.module`
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.module(input_ids)


@pytest.mark.parametrize("packed", [False, True])
def test_response_only_head_matches_the_full_projection(packed: bool) -> None:
    torch.manual_seed(0)
    model = _Wrapper(_ToyGPT())
    samples = grouped_samples(groups=2, per_group=3, seed=4)
    for s in samples:
        s.tokens = [t % HEAD_VOCAB for t in s.tokens]
    batch = build_packed_batch(samples, 0, varlen=True) if packed else build_padded_batch(samples, 0)
    results = []
    for selected in (False, True):
        model.zero_grad()
        if selected:
            assert select_positions(model, batch.logit_index, batch.logit_row)
            logits = response_view(model(batch.input_ids), batch.logit_index)
        else:
            logits = gather_response_logits(model(batch.input_ids), batch.logit_index, batch.logit_row)
        lp, h = reference_token_stats(logits, batch.targets, 1.0)
        mask = batch.response_mask.bool()
        ((lp + h) * mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((lp[mask], h[mask], grads))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # armed for one forward only: the next one projects every position again
    assert model(batch.input_ids).shape[:2] == batch.input_ids.shape
