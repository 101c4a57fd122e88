"""The megatron backend's response-only output layer and fused log-prob / entropy
(`response_head`, `token_stats`; pure torch, no megatron needed): the same values and
gradients as projecting every position and the unfused formulas, also with the vocab split
over two (gloo) TP ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from engines.train import token_stats as stats_module
from engines.train.batching import (
    PaddedBatch,
    build_padded_batch,
    gather_response_logits,
    log_probs_from_logits,
)
from engines.train.megatron.response_head import ResponseSlots, select_positions
from engines.train.packing import build_packed_batch
from engines.train.token_stats import token_stats
from storage.sample import Sample
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


def _batch(packed: bool, seed: int = 4) -> PaddedBatch:
    samples = grouped_samples(groups=2, per_group=3, seed=seed)  # responses of 0..5 tokens
    for s in samples:
        s.tokens = [t % HEAD_VOCAB for t in s.tokens]
    return build_packed_batch(samples, 0, varlen=True) if packed else build_padded_batch(samples, 0)


@pytest.mark.parametrize("packed", [False, True])
def test_response_slots_are_the_real_slots_in_row_major_order(packed: bool) -> None:
    batch = _batch(packed)
    slots = ResponseSlots.of(batch)
    rows, width = batch.logit_index.shape
    want = [(b, t) for b, n in enumerate(batch.response_lengths) for t in range(n)]
    assert slots.shape == (rows, width)
    assert slots.index.tolist()[0] == [b * width + t for b, t in want]
    row = batch.logit_row if batch.logit_row is not None else torch.arange(rows)[:, None]
    assert slots.index.tolist()[1] == [int(batch.logit_index[b, t]) for b, t in want]
    assert slots.index.tolist()[2] == [int(row.expand(rows, width)[b, t]) for b, t in want]
    torch.testing.assert_close(slots.gather(batch.targets), batch.targets[batch.response_mask.bool()])


def test_scatter_puts_each_value_at_its_slot_and_zero_elsewhere() -> None:
    batch = _batch(packed=True)
    slots = ResponseSlots.of(batch)
    n = slots.index.shape[1]
    x = torch.arange(1.0, n + 1).requires_grad_(True)
    out = slots.scatter(x)
    mask = batch.response_mask.bool()
    assert out.shape == mask.shape
    assert out[mask].tolist() == x.tolist() and not out[~mask].any()
    torch.testing.assert_close(slots.gather(out), x)  # gather undoes scatter
    w = torch.randn(out.shape)
    (out * w).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, w[mask])


def test_a_batch_of_empty_responses_has_no_slots() -> None:
    batch = build_packed_batch(
        [Sample(index=0, group_index=0, tokens=[5, 6], response_length=0, loss_mask=[])],
        0, varlen=True)
    slots = ResponseSlots.of(batch)
    assert slots.index.shape == (3, 0)
    lp, h = token_stats(torch.zeros(0, HEAD_VOCAB), slots.gather(batch.targets))
    assert slots.scatter(lp).tolist() == [[0.0]] and h.shape == (0,)


@pytest.mark.parametrize("packed", [False, True])
def test_response_only_head_matches_the_full_projection(packed: bool) -> None:
    """The real slots' logits (N rows) against every position projected and gathered at the
    `[B, R]` slots: equal log-probs and entropies at real slots, 0 at padding, equal grads."""
    torch.manual_seed(0)
    model = _Wrapper(_ToyGPT())
    batch = _batch(packed)
    mask = batch.response_mask.bool()
    w_lp, w_h = torch.randn(mask.shape), torch.randn(mask.shape)
    results = []
    for selected in (False, True):
        model.zero_grad()
        if selected:
            slots = ResponseSlots.of(batch)
            assert select_positions(model, slots)
            logits = model(batch.input_ids)
            assert logits.shape == (1, int(mask.sum()), HEAD_VOCAB)
            flat_lp, flat_h = reference_token_stats(logits[0], slots.gather(batch.targets), 1.0)
            lp, h = slots.scatter(flat_lp), slots.scatter(flat_h)
        else:
            logits = gather_response_logits(model(batch.input_ids), batch.logit_index, batch.logit_row)
            lp, h = reference_token_stats(logits, batch.targets, 1.0)
            lp, h = lp * mask, h * mask
        ((lp * w_lp).sum() + (h * w_h).sum()).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((lp, h, grads))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # armed for one forward only: the next one projects every position again
    assert model(batch.input_ids).shape[:2] == batch.input_ids.shape
