"""Response log-probs and entropy from (vocab-sharded) logits in one fused autograd step.

A small model with a large vocabulary (Qwen2-0.5B: hidden 896, vocab 151,936) spends most
of a step's non-matmul GPU time on `[tokens, V]` logits: the unfused path made an fp32 copy,
a clone for megatron's in-place cross entropy, a second fp32 pass for the entropy, and
autograd kept fp32 intermediates of each for backward. `token_stats` reads the (bf16)
logits chunk by chunk in fp32, keeps only three floats per token for backward, and its
backward recomputes the softmax from the saved logits: the gradient of
`log p(t) = z_t - lse` is `onehot(t) - p`, and of `H = lse - E_p[z]` is `-p (z - E_p[z])`
(z the tempered logits). With tensor parallelism each rank holds `V/tp` columns starting at
`vocab_start`; the row maxima and the three sums are all-reduced over `group`, and the
backward needs no communication. Pure torch: it runs (and is tested) on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

CHUNK_BYTES = 1 << 28  # fp32 bytes of logits per chunk: two such temporaries live at once


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


def _local_targets(targets: Tensor, vocab_start: int, vocab: int) -> tuple[Tensor, Tensor]:
    """(column in this shard, whether the target lies in this shard) per row."""
    local = targets - vocab_start
    mine = (local >= 0) & (local < vocab)
    return local.clamp(0, vocab - 1).unsqueeze(-1), mine


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: Tensor, targets: Tensor, temperature: float, group: Any,
        vocab_start: int,
    ) -> tuple[Tensor, Tensor]:
        vocab = logits.shape[-1]
        flat, tgt = logits.reshape(-1, vocab), targets.reshape(-1)
        n = flat.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        mean_z = torch.empty_like(lse)
        log_probs = torch.empty_like(lse)
        step = _rows_per_chunk(vocab)
        for a in range(0, n, step):
            z = flat[a:a + step].to(torch.float32, copy=True)  # never the saved input itself
            if temperature != 1.0:
                z.div_(temperature)
            peak = z.amax(dim=-1)
            if group is not None:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            z.sub_(peak.unsqueeze(-1))
            col, mine = _local_targets(tgt[a:a + step], vocab_start, vocab)
            picked = z.gather(-1, col).squeeze(-1) * mine
            e = z.exp()
            total = e.sum(-1)
            sums = torch.stack([total, e.mul_(z).sum(-1), picked])
            if group is not None:
                dist.all_reduce(sums, group=group)
            log_sum = sums[0].log()
            lse[a:a + step] = peak + log_sum
            mean_z[a:a + step] = peak + sums[1] / sums[0]
            log_probs[a:a + step] = sums[2] - log_sum
        ctx.save_for_backward(logits, targets, lse, mean_z)
        ctx.temperature, ctx.vocab_start = temperature, vocab_start
        shape = targets.shape
        return log_probs.view(shape), (lse - mean_z).view(shape)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, targets, lse, mean_z = ctx.saved_tensors
        temperature, vocab = ctx.temperature, logits.shape[-1]
        flat, tgt = logits.reshape(-1, vocab), targets.reshape(-1)
        g_lp = _or_zeros(grad_log_probs, lse)
        g_h = _or_zeros(grad_entropy, lse)
        grad = torch.empty_like(flat)
        step = _rows_per_chunk(vocab)
        for a in range(0, flat.shape[0], step):
            b = a + step
            z = flat[a:b].to(torch.float32, copy=True)
            if temperature != 1.0:
                z.div_(temperature)
            p = (z - lse[a:b].unsqueeze(-1)).exp_()
            # d/dz [g_lp * log p(t) + g_h * H] = g_lp * onehot(t) - p * (g_lp + g_h * (z - E[z]))
            z.sub_(mean_z[a:b].unsqueeze(-1)).mul_(g_h[a:b].unsqueeze(-1))
            z.add_(g_lp[a:b].unsqueeze(-1)).mul_(p).neg_()
            col, mine = _local_targets(tgt[a:b], ctx.vocab_start, vocab)
            z.scatter_add_(-1, col, (g_lp[a:b] * mine).unsqueeze(-1))
            if temperature != 1.0:
                z.div_(temperature)
            grad[a:b] = z
        return grad.view_as(logits), None, None, None, None


def _or_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad.reshape(-1).float()


def token_stats(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, group: Any = None,
    vocab_start: int = 0, entropy_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """`(log p(targets), entropy)` of `softmax(logits / temperature)` over the full vocab,
    both float32 shaped like `targets`; `logits` is `[..., V/tp]`, this rank's columns from
    `vocab_start` (`group`: the TP group, None for an unsplit vocab). The entropy carries a
    gradient only with `entropy_grad` (as a metric it is detached)."""
    log_probs, entropy = _TokenStats.apply(logits, targets, temperature, group, vocab_start)
    return log_probs, entropy if entropy_grad else entropy.detach()
