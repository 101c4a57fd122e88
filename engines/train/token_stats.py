"""Response log-probs and entropy from (vocab-sharded) logits in one fused autograd step, for
both trainers: megatron's vocab-parallel head (`megatron/schedule.py`) and the torch
trainer's HF head (`torch_models.response_outputs`).

A small model with a large vocabulary (Qwen2-0.5B: hidden 896, vocab 151,936) spends most
of a step's non-matmul GPU time on `[tokens, V]` logits: the unfused path made an fp32 copy,
a clone for megatron's in-place cross entropy, a second fp32 pass for the entropy, and
autograd kept fp32 intermediates of each for backward. `token_stats` reduces each row to
four floats (`row_stats`), keeps two per token for backward, and its backward recomputes the
softmax from the saved logits (`logit_grad`): the gradient of `log p(t) = z_t - lse` is
`onehot(t) - p`, and of `H = lse - E_p[z]` is `-p (z - E_p[z])` (z the tempered logits).
On CUDA, for a large vocabulary (`compiles`), both run through torch.compile, so the logits
are read once per pass in their own dtype; elsewhere (and if compiling fails) in fp32
chunks. With tensor parallelism each rank holds `V/tp` columns from `vocab_start`; the
ranks' row stats are all-gathered and combined exactly (`combine_stats`), and the backward
needs no communication. Pure torch: it runs (and is tested) on the CPU.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

CHUNK_BYTES = 1 << 28  # eager: fp32 bytes of logits per chunk (a few such temporaries live)


def row_stats(x: Tensor, col: Tensor, mine: Tensor, temperature: float) -> Tensor:
    """`[4, n]` per row of `[n, V]` logits, z = x / temperature: the row max m, sum(e),
    sum(e * (z - m)) with e = exp(z - m), and the target's z where this shard holds it
    (else 0). Shards' stats combine exactly (`combine_stats`)."""
    z = x.float() / temperature
    peak = z.amax(dim=-1, keepdim=True)
    shifted = z - peak
    e = shifted.exp()
    picked = z.gather(-1, col).squeeze(-1) * mine
    return torch.stack([peak.squeeze(-1), e.sum(-1), (e * shifted).sum(-1), picked])


def combine_stats(stats: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`[shards, 4, n]` -> (logsumexp, E_p[z], target z) over the whole vocab: with
    M = max m_r and w_r = exp(m_r - M), sum(e) = sum w_r s_r and
    sum(e * (z - M)) = sum w_r (q_r + (m_r - M) s_r)."""
    peak, total, moment, picked = stats.unbind(1)
    top = peak.amax(dim=0)
    w = (peak - top).exp()
    s = (w * total).sum(0)
    q = (w * (moment + (peak - top) * total)).sum(0)
    return top + s.log(), top + q / s, picked.sum(0)


def logit_grad(
    x: Tensor, col: Tensor, mine: Tensor, lse: Tensor, mean_z: Tensor, g_lp: Tensor,
    g_h: Tensor, temperature: float,
) -> Tensor:
    """d/dx [g_lp * log p(t) + g_h * H] = (g_lp * onehot(t) - p * (g_lp + g_h * (z - E[z]))) / T,
    in the dtype of `x`."""
    z = x.float() / temperature
    p = (z - lse.unsqueeze(-1)).exp()
    g = -p * (g_lp.unsqueeze(-1) + g_h.unsqueeze(-1) * (z - mean_z.unsqueeze(-1)))
    columns = torch.arange(x.shape[-1], device=x.device)
    g = g + torch.where(columns == col, (g_lp * mine).unsqueeze(-1), 0.0)
    return (g / temperature).to(x.dtype)


_compiled: dict[str, Callable[..., Tensor]] = {}
# The fewest logit columns (this rank's share of the vocabulary) worth compiling for. A
# smaller head's logits are a small part of a step's memory traffic, while compiling costs
# each process's first train step seconds: a tiny model's (vocabulary 80) first GRPO step
# on an H200 trained in 7.2-8.4 s, its later ones in 0.2-0.3 s (bench/RESULTS.md, "Async RL").
COMPILE_MIN_VOCAB = 8192


def compiles(is_cuda: bool, rows: int, vocab: int) -> bool:
    """Whether `_run` fuses `[rows, vocab]` logits with torch.compile: on CUDA, for a large
    vocabulary (`COMPILE_MIN_VOCAB`), for some rows (a micro-batch of empty responses has
    nothing to fuse, and no compiler failure to risk), unless ROLLFLOW_COMPILE_TOKEN_STATS
    is 0 (set by the first compiler failure)."""
    return (is_cuda and rows > 0 and vocab >= COMPILE_MIN_VOCAB
            and os.environ.get("ROLLFLOW_COMPILE_TOKEN_STATS", "1") != "0")


def _run(name: str, fn: Callable[..., Tensor], x: Tensor, *args: Any) -> Tensor | None:
    """`fn(x, *args)` through torch.compile where `compiles` says so (one fused kernel
    reading the logits once, no `[n, V]` fp32 temporaries); None elsewhere, and once
    compiling failed (warned once): the chunked eager path then runs."""
    if not compiles(x.is_cuda, x.shape[0] if x.numel() else 0, x.shape[-1]):
        return None
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    try:
        return _compiled[name](x, *args)
    except Exception as err:  # noqa: BLE001 - any compiler failure: use the eager path
        warnings.warn(f"token_stats: torch.compile failed ({err!r}); using eager chunks",
                      stacklevel=2)
        os.environ["ROLLFLOW_COMPILE_TOKEN_STATS"] = "0"
        return None


def _rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


def local_targets(targets: Tensor, vocab_start: int, vocab: int) -> tuple[Tensor, Tensor]:
    """(column in this shard `[n, 1]`, 1.0 where the target lies in this shard `[n]`)."""
    local = targets - vocab_start
    mine = ((local >= 0) & (local < vocab)).float()
    return local.clamp(0, vocab - 1).unsqueeze(-1), mine


def flat_row_stats(flat: Tensor, col: Tensor, mine: Tensor, temperature: float) -> Tensor:
    """`row_stats` of `[n, V]` logits: fused on CUDA, else in fp32 chunks of rows."""
    out = _run("stats", row_stats, flat, col, mine, temperature)
    if out is not None:
        return out
    step = _rows_per_chunk(flat.shape[-1])
    parts = [row_stats(flat[a : a + step], col[a : a + step], mine[a : a + step], temperature)
             for a in range(0, flat.shape[0], step)]
    return torch.cat(parts, dim=1) if parts else flat.new_zeros((4, 0), dtype=torch.float32)


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: Tensor, targets: Tensor, temperature: float, group: Any,
        vocab_start: int,
    ) -> tuple[Tensor, Tensor]:
        vocab = logits.shape[-1]
        flat = logits.reshape(-1, vocab)
        col, mine = local_targets(targets.reshape(-1), vocab_start, vocab)
        stats = flat_row_stats(flat, col, mine, temperature)
        if group is None:
            shards = stats.unsqueeze(0)
        else:
            parts = [torch.empty_like(stats) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, stats.contiguous(), group=group)
            shards = torch.stack(parts)
        lse, mean_z, picked = combine_stats(shards)
        ctx.save_for_backward(logits, col, mine, lse, mean_z)
        ctx.temperature = temperature
        shape = targets.shape
        return (picked - lse).view(shape), (lse - mean_z).view(shape)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        logits, col, mine, lse, mean_z = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        g_lp, g_h = or_zeros(grad_log_probs, lse), or_zeros(grad_entropy, lse)
        grad = flat_logit_grad(flat, (col, mine, lse, mean_z, g_lp, g_h), ctx.temperature)
        return grad.view_as(logits), None, None, None, None


def flat_logit_grad(flat: Tensor, per_row: tuple[Tensor, ...], temperature: float) -> Tensor:
    """`logit_grad` of `[n, V]` logits, `per_row` its (col, mine, lse, mean_z, g_lp, g_h):
    fused on CUDA, else in fp32 chunks of rows."""
    grad = _run("grad", logit_grad, flat, *per_row, temperature)
    if grad is None:
        grad = torch.empty_like(flat)
        step = _rows_per_chunk(flat.shape[-1])
        for a in range(0, flat.shape[0], step):
            c, m, lse_c, mean_c, g_lp_c, g_h_c = (t[a : a + step] for t in per_row)
            grad[a : a + step] = logit_grad(
                flat[a : a + step], c, m, lse_c, mean_c, g_lp_c, g_h_c, temperature
            )
    return grad


def or_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    """A backward's incoming gradient flattened to float32, zeros where none came."""
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
