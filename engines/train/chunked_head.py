"""`train.chunked_lm_head`: the LM head and the log-prob/entropy head of the torch trainer in
chunks of tokens, so a long sequence's `[tokens, vocab]` logits are never held whole.

With a 151,936-token vocabulary the response logits cost about 0.29 GiB per 1k tokens in
bf16, and their gradient as much again: at 32k tokens that is the largest part of a step's
peak once activation checkpointing has shrunk the layers' share (bench/RESULTS.md, "Torch
trainer under FSDP2"). Here the model runs with its head passed through (it returns the
final hidden states), and `head_token_stats` projects one chunk of them at a time, keeps
four floats a token (`token_stats.row_stats`) and drops the chunk's logits. The backward
projects each chunk again and turns its logit gradient straight into the hidden states' and
the head weight's gradients: one more LM-head forward of compute for the memory of one
chunk (the approach of Liger's fused linear cross entropy). The numbers are the unchunked
path's up to the matmuls' rounding (tests/unit/test_chunked_head.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from engines.train.token_stats import (
    combine_stats,
    flat_logit_grad,
    flat_row_stats,
    local_targets,
    or_zeros,
)

CHUNK_BYTES = 1 << 29  # logits of one chunk in the compute dtype


def rows_per_chunk(vocab: int, dtype: torch.dtype, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens a chunk: its `[rows, vocab]` logits fit in `chunk_bytes`."""
    return max(1, chunk_bytes // (vocab * torch.finfo(dtype).bits // 8))


def output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The LM head (`get_output_embeddings`) of an HF causal LM, through DDP and peft."""
    inner: Any = getattr(model, "module", model)  # DDP
    get_base = getattr(inner, "get_base_model", None)  # peft
    base = get_base() if callable(get_base) else inner
    head = base.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"train.chunked_lm_head: the model's LM head is a "
                         f"{type(head).__name__}, not a Linear layer")
    if head.bias is not None:
        raise ValueError("train.chunked_lm_head: an LM head with a bias is not supported")
    return head


def _passthrough(hidden: Tensor) -> Tensor:
    return hidden


@contextlib.contextmanager
def head_passed_through(model: torch.nn.Module) -> Iterator[torch.nn.Linear]:
    """Within: the model's forward returns its final hidden states as `logits` (the head's
    forward is the identity; its weight and the module tree are untouched, so DDP's and
    FSDP2's hooks and the checkpoint names are the usual ones). Yields the head."""
    head = output_head(model)
    head.forward = _passthrough  # type: ignore[method-assign,assignment]
    try:
        yield head
    finally:
        del head.forward


@contextlib.contextmanager
def maybe_passed_through(model: torch.nn.Module, chunked: bool
                         ) -> Iterator[torch.nn.Linear | None]:
    """`head_passed_through` when `chunked`, else nothing changes and None is yielded."""
    if not chunked:
        yield None
        return
    with head_passed_through(model) as head:
        yield head


def plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """`output_head(model)` where it is a Linear layer without a bias, else None."""
    try:
        return output_head(model)
    except (ValueError, AttributeError, NotImplementedError):
        return None


@contextlib.contextmanager
def head_on_positions(head: torch.nn.Linear, keep: Tensor, passthrough: bool
                      ) -> Iterator[torch.nn.Linear]:
    """Within: the LM head `head` projects only positions `keep` (`[rows, K]`) of each row
    of the final hidden states, so the model returns `[rows, K, V]` logits (`passthrough`:
    those positions' hidden states, for `head_token_stats`). It is what transformers'
    per-row `logits_to_keep` does, where the installed transformers has it, done in the
    head itself; inside the model's forward, so DDP and FSDP2 see the head used as usual."""
    rows = torch.arange(keep.shape[0], device=keep.device).unsqueeze(-1)

    def forward(hidden: Tensor) -> Tensor:
        picked = hidden[rows, keep]
        return picked if passthrough else torch.nn.functional.linear(picked, head.weight)

    head.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield head
    finally:
        del head.forward


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype autocast would run the head's matmul in (the backward has no autocast)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return dtype


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
        chunk_bytes: int,
    ) -> tuple[Tensor, Tensor]:
        dtype = compute_dtype(hidden.device, hidden.dtype)
        vocab = weight.shape[0]
        step = rows_per_chunk(vocab, dtype, chunk_bytes)
        col, mine = local_targets(targets, 0, vocab)
        w = weight.to(dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            parts = [flat_row_stats(hidden[a : a + step].to(dtype) @ w.T, col[a : a + step],
                                    mine[a : a + step], temperature)
                     for a in range(0, hidden.shape[0], step)]
        stats = torch.cat(parts, dim=1) if parts else hidden.new_zeros((4, 0), dtype=torch.float32)
        lse, mean_z, picked = combine_stats(stats.unsqueeze(0))
        ctx.save_for_backward(hidden, weight, col, mine, lse, mean_z)
        ctx.temperature, ctx.step, ctx.dtype = temperature, step, dtype
        return picked - lse, lse - mean_z

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_log_probs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, col, mine, lse, mean_z = ctx.saved_tensors
        step, dtype = ctx.step, ctx.dtype
        per_row = (col, mine, lse, mean_z, or_zeros(grad_log_probs, lse),
                   or_zeros(grad_entropy, lse))
        w = weight.to(dtype)
        grad_hidden = torch.empty_like(hidden)
        # summed over the chunks in at least float32 (a bf16 head's gradient too)
        total = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=total, device=weight.device)
        for a in range(0, hidden.shape[0], step):
            h = hidden[a : a + step].to(dtype)
            g = flat_logit_grad(h @ w.T, tuple(t[a : a + step] for t in per_row),
                                ctx.temperature)
            grad_hidden[a : a + step] = g @ w
            grad_weight += (g.T @ h).to(total)
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None


def head_token_stats(
    hidden: Tensor, head: torch.nn.Linear, targets: Tensor, temperature: float,
    entropy_grad: bool, chunk_bytes: int = CHUNK_BYTES,
) -> tuple[Tensor, Tensor]:
    """`token_stats(head(hidden), targets, temperature)` a chunk of tokens at a time:
    `(log_probs, entropy)` float32 shaped like `targets`, from `hidden` `[..., H]`."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    log_probs, entropy = _ChunkedHead.apply(flat, head.weight, targets.reshape(-1),
                                            temperature, chunk_bytes)
    log_probs, entropy = log_probs.view(targets.shape), entropy.view(targets.shape)
    return log_probs, entropy if entropy_grad else entropy.detach()
