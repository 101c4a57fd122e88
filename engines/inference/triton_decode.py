"""Fused Triton kernels for the CUDA-graph decode step (`cuda_graph_decode`), GPU only.

At batch 256 on the Qwen2-0.5B shape the captured step was ~33 kernels a layer, most of
them tiny elementwise ones (1.3 ms of a 4.6 ms step), attention read every cache column
(reserved ones too) in two batched matmuls (~0.45 ms), and sampling ran a float32 copy of the
logits, a log-softmax and a cumsum over the 151,936-token vocabulary (~0.6 ms; bench/RESULTS.md,
"Embedded engine vs HF generate on a GPU"). Here a layer is eight kernels: RMSNorm, the q|k|v
matmul, one attention kernel (RoPE on q and k, the new key and value stored, attention over
the written columns only, online softmax), the o matmul with its residual, RMSNorm, gate|up,
SiLU times up, down with its residual. Sampling is one kernel a row that reads the logits in
the model dtype twice: max and sum, then the CDF walk up to the sampled token.

The arithmetic is the eager step's (`kv_decode._decode_layer`, `sampling.sample_tokens`):
RMSNorm rounds to the model dtype before its weight as HF does; the draw is the same inverse
CDF of the float32 distribution (only float rounding at a CDF step can pick another token);
attention's scores stay float32 (the eager step rounds them to the model dtype). Triton ships
with torch's CUDA wheels; where it does not import, the eager ops run (`available`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_ATTN_BLOCK = 64  # cache columns an attention iteration reads
_ATTN_WARPS = 4  # (bench.decode_kernels, column 190: 2 warps 16.5 us, 4 warps 17.3; the batch
#                   figures in bench/RESULTS.md ran with 4)
_ATTN_STAGES = 2
_SAMPLE_CHUNK = 8192  # vocabulary entries a first-pass sampling program reads
_SAMPLE_BLOCK = 2048  # entries the second pass reads at a time, inside one chunk


@functools.cache
def available() -> bool:
    """Triton imports (it ships with torch's CUDA wheels, not its CPU ones)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def supports(head_dim: int, group: int) -> bool:
    """Shapes the attention kernel takes: a power-of-two head size of at least 16 (Triton's
    block shapes and `tl.dot`) and at most 16 query heads per key head (one padded tile)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and group <= 16


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _kernels() -> dict[str, Any]:
    """The kernels, defined on first use (importing triton is not free, and CPU machines
    lack it)."""
    import triton
    import triton.language as tl

    @triton.jit
    def rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, eps, stride_x, stride_out,
                        BLOCK: tl.constexpr):
        row = tl.program_id(0)
        idx = tl.arange(0, BLOCK)
        valid = idx < n
        x = tl.load(x_ptr + row * stride_x + idx, mask=valid, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + idx, mask=valid, other=0.0)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
        h = (x * inv).to(w.dtype)  # HF: normalised in float32, rounded, then the weight
        tl.store(out_ptr + row * stride_out + idx, (h * w).to(w.dtype), mask=valid)

    @triton.jit
    def silu_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_out, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = idx < n
        gate = tl.load(gu_ptr + row * stride_gu + idx, mask=valid, other=0.0)
        up = tl.load(gu_ptr + row * stride_gu + n + idx, mask=valid, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu rounded, then times up (eager)
        tl.store(out_ptr + row * stride_out + idx, (act * up).to(gate.dtype), mask=valid)

    @triton.jit
    def attention_kernel(
        qkv_ptr, kv_ptr, mask_ptr, col_ptr, pos_ptr, rope_ptr, out_ptr, scale,
        stride_qkv, stride_kv_row, stride_kv_head, stride_kv_kind, stride_kv_col,
        stride_mask, stride_rope, stride_out,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
        G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    ):
        row = tl.program_id(0)
        kh = tl.program_id(1)
        col = tl.load(col_ptr)
        pos = tl.load(pos_ptr + row)
        d = tl.arange(0, D)
        rot = (d + D // 2) % D  # roll by half: the table's sin has rotate_half's sign folded in
        cos = tl.load(rope_ptr + pos * stride_rope + d).to(tl.float32)
        sin = tl.load(rope_ptr + pos * stride_rope + D + d).to(tl.float32)
        base = qkv_ptr + row * stride_qkv
        k_at = base + (HEADS + kh) * D
        k_raw = tl.load(k_at + d)
        key = (k_raw.to(tl.float32) * cos + tl.load(k_at + rot).to(tl.float32) * sin)
        value = tl.load(base + (HEADS + KV_HEADS + kh) * D + d)
        cache = kv_ptr + row * stride_kv_row + kh * stride_kv_head
        tl.store(cache + col * stride_kv_col + d, key.to(k_raw.dtype))
        tl.store(cache + stride_kv_kind + col * stride_kv_col + d, value)
        tl.debug_barrier()  # the block's own store is read back below, at column `col`

        g = tl.arange(0, G_PAD)
        q_at = base + (kh * GROUP + g)[:, None] * D
        q_valid = (g < GROUP)[:, None]
        q = tl.load(q_at + d[None, :], mask=q_valid, other=0.0).to(tl.float32) * cos[None, :]
        q += tl.load(q_at + rot[None, :], mask=q_valid, other=0.0).to(tl.float32) * sin[None, :]
        q = q.to(k_raw.dtype)
        best = tl.full([G_PAD], -1.0e30, tl.float32)
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D], tl.float32)
        for start in range(0, col + 1, BLOCK_N):
            # the mask, keys and values are loaded side by side (no load waits on another)
            n = start + tl.arange(0, BLOCK_N)
            written = n <= col
            real = tl.load(mask_ptr + row * stride_mask + n, mask=written, other=0) != 0
            keys = tl.load(cache + n[:, None] * stride_kv_col + d[None, :],
                           mask=written[:, None], other=0.0)
            values = tl.load(cache + stride_kv_kind + n[:, None] * stride_kv_col + d[None, :],
                             mask=written[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(keys), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(keys))
            s = tl.where(real[None, :], s * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, axis=1))
            alpha = tl.exp(best - new_best)
            p = tl.exp(s - new_best[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p.to(values.dtype), values, input_precision="ieee")
            else:
                pv = tl.dot(p.to(values.dtype), values)
            acc = acc * alpha[:, None] + pv
            best = new_best
        out = acc / total[:, None]
        o_at = out_ptr + row * stride_out + (kh * GROUP + g)[:, None] * D + d[None, :]
        tl.store(o_at, out.to(k_raw.dtype), mask=q_valid)

    @triton.jit
    def sample_chunks_kernel(
        logits_ptr, stride_row, vocab, div_ptr, stats_ptr, top_ptr,
        CHUNKS: tl.constexpr, CHUNK: tl.constexpr, HAS_DIV: tl.constexpr,
    ):
        # per chunk of a row: max and sum of exp of logits / T, the largest logit and its
        # first index (pass 1, `CHUNKS` programs a row, so that the whole GPU reads)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        idx = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row * stride_row + idx, mask=idx < vocab,
                    other=float("-inf")).to(tl.float32)
        z = x / tl.load(div_ptr + row) if HAS_DIV else x
        best = tl.max(z, axis=0)
        at = (row * CHUNKS + chunk) * 2
        tl.store(stats_ptr + at, best)
        tl.store(stats_ptr + at + 1, tl.sum(tl.exp(z - best), axis=0))
        top_i = tl.argmax(x, axis=0)
        tl.store(top_ptr + at, tl.max(x, axis=0))
        tl.store(top_ptr + at + 1, (chunk * CHUNK + top_i).to(tl.float32))

    @triton.jit
    def sample_pick_kernel(
        logits_ptr, stride_row, vocab, div_ptr, u_ptr, greedy_ptr, stats_ptr, top_ptr,
        tok_ptr, logp_ptr, CHUNKS: tl.constexpr, C_PAD: tl.constexpr, CHUNK: tl.constexpr,
        BLOCK: tl.constexpr, HAS_DIV: tl.constexpr, HAS_U: tl.constexpr,
        HAS_GREEDY: tl.constexpr,
    ):
        # pass 2, a program a row: the chunks' figures combined; then the first token whose
        # running sum passes u * total (searchsorted, right=True, on the CDF), walked inside
        # the one chunk that holds it; past the end (rounding): the last token, as clamped
        row = tl.program_id(0)
        c = tl.arange(0, C_PAD)
        valid = c < CHUNKS
        at = (row * CHUNKS + c) * 2
        bests = tl.load(stats_ptr + at, mask=valid, other=float("-inf"))
        sums = tl.load(stats_ptr + at + 1, mask=valid, other=0.0)
        best = tl.max(bests, axis=0)
        scaled = sums * tl.exp(bests - best)
        total = tl.sum(scaled, axis=0)
        tops = tl.load(top_ptr + at, mask=valid, other=float("-inf"))
        first_chunk = tl.argmax(tops, axis=0)  # the first chunk holding the largest logit
        top_i = tl.load(top_ptr + (row * CHUNKS + first_chunk) * 2 + 1).to(tl.int32)
        div = tl.load(div_ptr + row) if HAS_DIV else 1.0
        pick = top_i
        if HAS_U:
            target = tl.load(u_ptr + row) * total
            ends = tl.cumsum(scaled, axis=0)
            chunk = tl.min(tl.where(ends > target, c, CHUNKS), axis=0)
            found = vocab - 1
            if chunk < CHUNKS:
                running = tl.sum(tl.where(c < chunk, scaled, 0.0), axis=0)
                start = chunk * CHUNK
                stop = tl.minimum(start + CHUNK, vocab)
                found = stop - 1  # (the chunk's own sum, rounded, passed the target)
                while start < stop:
                    idx = start + tl.arange(0, BLOCK)
                    x = tl.load(logits_ptr + row * stride_row + idx, mask=idx < stop,
                                other=float("-inf")).to(tl.float32)
                    p = tl.exp((x / div if HAS_DIV else x) - best)
                    hit = tl.min(tl.where(tl.cumsum(p, axis=0) + running > target, idx, vocab),
                                 axis=0)
                    running += tl.sum(p, axis=0)
                    if hit < vocab:
                        found = hit
                        start = stop
                    else:
                        start += BLOCK
            x_found = tl.load(logits_ptr + row * stride_row + found).to(tl.float32)
            p_found = tl.exp((x_found / div if HAS_DIV else x_found) - best)
            sampled = tl.where(p_found > 0, found, top_i)  # never a zero-probability token
            if HAS_GREEDY:
                pick = tl.where(tl.load(greedy_ptr + row) != 0, top_i, sampled)
            else:
                pick = sampled
        x_pick = tl.load(logits_ptr + row * stride_row + pick).to(tl.float32)
        z_pick = x_pick / div if HAS_DIV else x_pick
        tl.store(tok_ptr + row, pick)  # (stored as the int64 it points to)
        tl.store(logp_ptr + row, z_pick - best - tl.log(total))

    return {"rms_norm": rms_norm_kernel, "silu_mul": silu_mul_kernel,
            "attention": attention_kernel, "sample_chunks": sample_chunks_kernel,
            "sample_pick": sample_pick_kernel}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`kv_decode._rms_norm` of `[rows, hidden]` in one kernel."""
    rows, n = x.shape
    out = torch.empty_like(x)
    _kernels()["rms_norm"][(rows,)](x, weight, out, n, eps, x.stride(0), out.stride(0),
                                    BLOCK=_pow2(n))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` of the fused gate|up projection `[rows, 2 * n]`, in one kernel."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, n)
    block = min(1024, _pow2(n))
    _kernels()["silu_mul"][(rows, -(-n // block))](gate_up, out, n, gate_up.stride(0),
                                                   out.stride(0), BLOCK=block)
    return out


def attention(
    qkv: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, col: torch.Tensor,
    positions: torch.Tensor, rope: torch.Tensor, heads: int, kv_heads: int, scale: float,
    block: int = _ATTN_BLOCK, warps: int = _ATTN_WARPS, stages: int = _ATTN_STAGES,
) -> torch.Tensor:
    """One new token per row: RoPE on its q and k heads (`qkv` `[rows, (heads + 2 kv_heads)
    * d]`, before RoPE; `rope` `[positions, 2, d]`, cos and sign-folded sin), its key and value
    stored at column `col` (a 1-element device tensor) of `kv` (`[rows, kv_heads, 2, capacity,
    d]`), and attention over columns `0..col` where `mask` is set. Returns `[rows, heads * d]`.
    Only the written columns are read: the eager step read all of the cache's capacity."""
    rows, d = kv.shape[0], kv.shape[-1]
    group = heads // kv_heads
    out = qkv.new_empty(rows, heads * d)
    assert qkv.stride(1) == 1 and kv.stride(-1) == 1 and rope.is_contiguous()
    _kernels()["attention"][(rows, kv_heads)](
        qkv, kv, mask, col, positions, rope, out, scale,
        qkv.stride(0), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        mask.stride(0), rope.stride(0), out.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group, G_PAD=max(16, _pow2(group)), D=d,
        BLOCK_N=block, IEEE=qkv.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def sample(
    logits: torch.Tensor, divisor: torch.Tensor | None, uniform: torch.Tensor | None,
    greedy: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampling.sample_tokens` for rows without top-p/top-k, on logits in the model dtype:
    (tokens, float32 log-probs of logits / T). `divisor` `[rows, 1]` (None: all 1), `uniform`
    `[rows]` (None: every row greedy), `greedy` bool `[rows]` (None: no row greedy)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and vocab < 1 << 24  # (indices travel as exact float32)
    chunks = -(-vocab // _SAMPLE_CHUNK)
    stats = torch.empty(rows, chunks, 2, dtype=torch.float32, device=logits.device)
    tops = torch.empty_like(stats)  # (the largest logit and its index, exact in float32)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    kernels = _kernels()
    div = divisor if divisor is not None else logp
    kernels["sample_chunks"][(rows, chunks)](
        logits, logits.stride(0), vocab, div, stats, tops, CHUNKS=chunks, CHUNK=_SAMPLE_CHUNK,
        HAS_DIV=divisor is not None, num_warps=8,
    )  # fmt: skip
    kernels["sample_pick"][(rows,)](
        logits, logits.stride(0), vocab, div, uniform if uniform is not None else logp,
        greedy if greedy is not None else logp, stats, tops, tokens, logp, CHUNKS=chunks,
        C_PAD=_pow2(chunks), CHUNK=_SAMPLE_CHUNK, BLOCK=_SAMPLE_BLOCK,
        HAS_DIV=divisor is not None, HAS_U=uniform is not None,
        HAS_GREEDY=greedy is not None and uniform is not None,
    )  # fmt: skip
    return tokens, logp
