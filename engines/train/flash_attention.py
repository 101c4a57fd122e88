"""`train.flash_attention`: the torch trainer's attention without a materialized mask, so
SDPA can run its flash kernels.

A 4-D boolean mask sends `scaled_dot_product_attention` to kernels that take one (the
memory-efficient one on a GPU), which compute every query/key pair of a row, the masked
half of a causal row too, and run slower than flash attention per pair. Two layouts need
no mask:

- padded rows (`batching.build_padded_batch`): the padding is at each row's end, so plain
  causal attention never lets it reach a real token. The forward drops the padding mask and
  transformers' sdpa takes `is_causal` (`attention_mask_for`).
- packed rows (`train.pack_sequences` without shared prompts): a micro-batch is one row of
  exactly its real tokens, the samples given by `cu_seqlens`; `attention` runs them through
  `torch.nn.attention.varlen.varlen_attn` (flash varlen, bf16/fp16 on a GPU) and elsewhere
  (float32, the CPU) through causal SDPA one sequence at a time.

Each token sees the same keys at the same positions as in its padded, masked row, so the
log-probs and gradients are the masked path's up to the kernels' float rounding
(tests/unit/test_flash_attention.py, tests/gpu/test_flash_attention.py).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor

from engines.train.batching import PaddedBatch

ATTENTION_NAME = "rollflow_flash"  # the transformers attention implementation of this module
CU_SEQLENS = "cu_seq_lens_q"  # transformers' keyword names for packed sequences
MAX_LENGTH = "max_length_q"


def attention_mask_for(batch: PaddedBatch, keep_padding_mask: bool) -> Tensor | None:
    """The mask the forward passes: None (causal attention alone) for right-padded rows, a
    packed row (all real tokens: transformers then builds no mask), else the batch's own.
    `keep_padding_mask`: an MoE model's router loss reads the 2-D padding mask."""
    mask = batch.attention_mask
    if keep_padding_mask or mask.dim() != 2:
        return mask
    if batch.cu_seqlens is not None:
        return mask  # [1, T] ones: no packed-sequence mask is inferred from the positions
    return None if batch.position_ids is None else mask


def varlen_kwargs(batch: PaddedBatch) -> dict[str, Any]:
    """The forward's keywords for a varlen-packed batch (transformers hands them down to
    `attention`); empty for any other layout."""
    cu = batch.cu_seqlens
    if cu is None:
        return {}
    longest = int((cu[1:] - cu[:-1]).max())
    return {CU_SEQLENS: cu, "cu_seq_lens_k": cu, MAX_LENGTH: longest, "max_length_k": longest}


@functools.cache
def _varlen_options() -> tuple[bool, frozenset[str]] | None:
    """Whether torch has `varlen_attn`, and the keywords of its signature (they changed
    between releases: `is_causal` earlier, `window_size` later)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return True, frozenset(inspect.signature(varlen_attn).parameters)


def flash_varlen_ok(query: Tensor) -> bool:
    """Whether the flash varlen kernel takes `query`: CUDA, half precision, torch has it."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)
            and _varlen_options() is not None)


def varlen_causal(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int,
                  scale: float | None) -> Tensor:
    """Causal attention of the sequences `cu` lays end to end: `[T, H, D]` queries,
    `[T, Hkv, D]` keys and values -> `[T, H, D]`."""
    groups = q.shape[1] // k.shape[1]
    if flash_varlen_ok(q):
        from torch.nn.attention.varlen import varlen_attn

        options = _varlen_options()
        assert options is not None
        params = options[1]
        kw: dict[str, Any] = {"scale": scale}
        if "is_causal" in params:
            kw["is_causal"] = True
        else:
            kw["window_size"] = (-1, 0)
        if groups > 1 and "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = varlen_attn(q, k, v, cu, cu, longest, longest, **kw)
        assert isinstance(out, Tensor)  # (no auxiliary outputs asked for)
        return out
    # float32 or the CPU: causal SDPA per sequence (the kernel needs half precision)
    outs = []
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=0), vs.repeat_interleave(groups, dim=0)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
    return torch.cat(outs, dim=0)


def attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
    attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention transformers runs under `ATTENTION_NAME`: a varlen-packed forward (its
    `cu_seq_lens_q` keyword) through `varlen_causal`, any other through transformers' sdpa
    (with whatever mask the batch brought)."""
    cu = kwargs.get(CU_SEQLENS)
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"varlen attention takes one packed row, not {query.shape[0]}")
    # one dtype: under autocast the rotary embedding leaves queries and keys in float32
    q, k, v = (t[0].transpose(0, 1).to(value.dtype) for t in (query, key, value))
    out = varlen_causal(q, k, v, cu, int(kwargs[MAX_LENGTH]), scaling)
    return out.unsqueeze(0), None


def runs_flash_attention(model: torch.nn.Module) -> bool:
    """Whether `model` (or the module DDP wraps) runs `attention` (`use_flash_attention`)."""
    config = getattr(getattr(model, "module", model), "config", None)
    return getattr(config, "_attn_implementation", None) == ATTENTION_NAME


def use_flash_attention(model: torch.nn.Module) -> None:
    """Run `model`'s (a transformers model's) attention through `attention`; its masks are
    still built as for sdpa, which it falls back to."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION_NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config: Any = getattr(model, "config", None)
    if config is not None:
        config._attn_implementation = ATTENTION_NAME
