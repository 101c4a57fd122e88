"""RoPE for megatron's packed (`thd`) micro-batches in one pass over all tokens.

Why: without TE's fused kernel (`apply_rope_fusion` off, as here), megatron-core applies
RoPE to a `thd` batch in `rope_utils._apply_rotary_pos_emb_thd`, which reads the sequence
lengths to the host (`.tolist()`, a device sync) and then runs the rotation one sequence at
a time: a sync and a dozen small kernels per sequence, for q and for k, in every layer,
forward and backward. That made `train.pack_sequences` slower than the padding it saves
(bench/RESULTS.md, "Megatron GRPO"). `packed_rope` finds each token's position within its
sequence on the device from `cu_seqlens` and rotates every token at once: the same
arithmetic per element, so the same numbers bit for bit.

How it gets in: megatron's `Attention.forward` calls the `apply_rotary_pos_emb` that
`megatron.core.transformer.attention` imported by name, and offers no hook for another.
`install()` rebinds that one name to `apply_rotary_pos_emb` below, which takes the calls
`packed_rope` covers (a `thd` batch, context-parallel size 1, no RoPE fusion, no MLA) and
passes every other call to megatron's function unchanged. A subclass would have to copy
`Attention.forward` (some 300 lines that change with each megatron release) to change one
call. Megatron is imported inside the functions: this module imports without it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def positions_in_sequence(cu_seqlens: Tensor, total: int) -> Tensor:
    """Each of `total` tokens' position within its sequence, `[total]`, on `cu_seqlens`'s
    device: token j of sequence i (`cu_seqlens[i] <= j < cu_seqlens[i + 1]`) is at
    `j - cu_seqlens[i]`. `total` comes from a shape, so nothing waits for the device."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # sequences ending at or before token j (empty ones included) = the index of j's sequence
    seq = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
    return (tokens - cu_seqlens[seq]).long()


def _rotate_half(x: Tensor, interleaved: bool) -> Tensor:
    """`[x1, x2] -> [-x2, x1]` over halves, or over (even, odd) pairs when `interleaved`."""
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def packed_rope(
    t: Tensor, cu_seqlens: Tensor, freqs: Tensor, interleaved: bool = False,
    mscale: float = 1.0,
) -> Tensor:
    """RoPE on `[T, heads, d]` tokens of sequences laid end to end (`cu_seqlens`: `[n + 1]`
    start offsets ending at T), positions restarting at 0 in each sequence; megatron's
    `_apply_rotary_pos_emb_thd` at context-parallel size 1, without its per-sequence loop.

    `freqs` is megatron's `[rows, 1, 1, rot_dim]` angle table (rot_dim <= d; the rest of
    each head passes through); as in megatron, a table with a row per token (rows == T) is
    read as the tokens' own angles. `interleaved`: megatron's `rotary_interleaved`."""
    total = t.shape[0]
    if freqs.shape[0] == total:
        angles = freqs
    else:
        angles = freqs[positions_in_sequence(cu_seqlens.to(t.device), total)]
    rot = freqs.shape[-1]
    angles = angles.reshape(total, 1, rot)
    x, rest = t[..., :rot], t[..., rot:]
    cos = (torch.cos(angles) * mscale).to(t.dtype)
    sin = (torch.sin(angles) * mscale).to(t.dtype)
    out = (x * cos) + (_rotate_half(x, interleaved) * sin)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def apply_rotary_pos_emb(
    t: Tensor, freqs: Tensor, config: Any, cu_seqlens: Tensor | None = None,
    mscale: float = 1.0, cp_group: Any = None, mla_rotary_interleaved: bool | None = False,
) -> Tensor:
    """megatron's `rope_utils.apply_rotary_pos_emb` (same signature), with the `thd` calls
    `packed_rope` covers going there instead."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils

    group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
    if (
        cu_seqlens is None or config.apply_rope_fusion or config.multi_latent_attention
        or mla_rotary_interleaved is not False or group.size() != 1
    ):
        return rope_utils.apply_rotary_pos_emb(
            t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group,
            mla_rotary_interleaved=mla_rotary_interleaved,
        )
    return packed_rope(t, cu_seqlens, freqs, config.rotary_interleaved, mscale)


def install() -> None:
    """Route megatron attention's RoPE calls through `apply_rotary_pos_emb` (see the module
    docstring): for this whole process, once; calling again changes nothing."""
    from megatron.core.transformer import attention

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
