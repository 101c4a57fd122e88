"""The megatron backend's response-only output layer and fused log-prob / entropy
(`response_head`, `token_stats`; pure torch, no megatron needed): the same values and
gradients as projecting every position and the unfused formulas, also with the vocab split
over two (gloo) TP ranks."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from engines.algorithms.losses import entropy_from_logits
from engines.process import free_port
from engines.train.batching import build_padded_batch, gather_response_logits, log_probs_from_logits
from engines.train.megatron import token_stats as stats_module
from engines.train.megatron.response_head import response_view, select_positions
from engines.train.megatron.token_stats import token_stats
from engines.train.packing import build_packed_batch
from tests.unit.test_prompt_sharing import grouped_samples

VOCAB = 40


def _reference(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    z = logits.float() / temperature
    return log_probs_from_logits(z, targets), entropy_from_logits(z)


def _grads(logits: Tensor, fn: Any, w_lp: Tensor, w_h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    x = logits.detach().clone().requires_grad_(True)
    lp, h = fn(x)
    ((lp * w_lp).sum() + (h * w_h).sum()).backward()
    assert x.grad is not None
    return lp.detach(), h.detach(), x.grad.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_stats_match_the_unfused_formulas(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, temperature: float
) -> None:
    monkeypatch.setattr(stats_module, "CHUNK_BYTES", 4 * VOCAB * 5)  # 5 rows a chunk: 3 chunks
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 4, VOCAB, generator=gen) * 3).to(dtype)
    targets = torch.randint(0, VOCAB, (3, 4), generator=gen)
    w_lp, w_h = torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)
    fused = _grads(logits, lambda x: token_stats(x, targets, temperature), w_lp, w_h)
    plain = _grads(logits, lambda x: _reference(x, targets, temperature), w_lp, w_h)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert fused[2].dtype == torch.float32 and fused[0].dtype == torch.float32


def test_detached_entropy_gives_the_log_prob_gradient_alone() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, VOCAB, generator=gen)
    targets = torch.randint(0, VOCAB, (2, 3), generator=gen)
    x = logits.clone().requires_grad_(True)
    lp, h = token_stats(x, targets, entropy_grad=False)
    assert not h.requires_grad
    lp.sum().backward()
    ref = logits.clone().requires_grad_(True)
    log_probs_from_logits(ref, targets).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, atol=1e-6, rtol=1e-5)


def _tp_rank(rank: int, port: int, logits: Tensor, targets: Tensor, w: Tensor, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        half = VOCAB // 2
        shard = logits[..., rank * half:(rank + 1) * half].clone().requires_grad_(True)
        lp, h = token_stats(shard, targets, 0.9, dist.group.WORLD, rank * half)
        ((lp + h) * w).sum().backward()
        out[rank] = (lp.detach(), h.detach(), shard.grad)
    finally:
        dist.destroy_process_group()


def test_token_stats_over_a_vocab_split_in_two() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 5, VOCAB, generator=gen) * 2
    targets = torch.randint(0, VOCAB, (3, 5), generator=gen)
    w = torch.randn(3, 5, generator=gen)
    out = mp.Manager().dict()
    mp.spawn(_tp_rank, args=(free_port(), logits, targets, w, out), nprocs=2, join=True)
    lp, h, grad = _grads(logits, lambda x: _reference(x, targets, 0.9), w, w)
    for rank in (0, 1):
        torch.testing.assert_close(out[rank][0], lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[rank][1], h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([out[0][2], out[1][2]], dim=-1), grad, atol=1e-5, rtol=1e-5)


class _Head(nn.Module):
    """Called as megatron calls a GPTModel's output layer: `(hidden [s, b, h], weight=...)`."""

    def forward(self, hidden: Tensor, weight: Tensor, runtime_gather_output: Any = None) -> tuple[Tensor, None]:
        return hidden @ weight.T, None


class _ToyGPT(nn.Module):
    """A GPTModel's output convention: hidden `[s, b, h]`, logits returned as `[b, s, V]`."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 16)
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
        s.tokens = [t % VOCAB for t in s.tokens]
    batch = build_packed_batch(samples, 0, varlen=True) if packed else build_padded_batch(samples, 0)
    results = []
    for selected in (False, True):
        model.zero_grad()
        if selected:
            assert select_positions(model, batch.logit_index, batch.logit_row)
            logits = response_view(model(batch.input_ids), batch.logit_index)
        else:
            logits = gather_response_logits(model(batch.input_ids), batch.logit_index, batch.logit_row)
        lp, h = _reference(logits, batch.targets, 1.0)
        mask = batch.response_mask.bool()
        ((lp + h) * mask).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((lp[mask], h[mask], grads))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # armed for one forward only: the next one projects every position again
    assert model(batch.input_ids).shape[:2] == batch.input_ids.shape
