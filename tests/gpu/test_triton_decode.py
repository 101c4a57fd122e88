"""The CUDA-graph decode step's Triton kernels (`triton_decode`) against the eager ops they
replace: RMSNorm, SiLU times up, attention with RoPE and the cache store, and sampling."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engines.inference import triton_decode
from engines.inference.kv_decode import _decode_attention, _rms_norm
from engines.inference.sampling import SamplingRows, sample_tokens

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_silu_mul_equal_the_eager_ops(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(37, 896, device="cuda", dtype=dtype)
    w = torch.rand(896, device="cuda", dtype=dtype) + 0.5
    torch.testing.assert_close(triton_decode.rms_norm(x, w, 1e-6), _rms_norm(x, w, 1e-6),
                               atol=_tol(dtype), rtol=_tol(dtype))
    gate_up = torch.randn(37, 2 * 4864, device="cuda", dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate.clone()).mul_(up)
    torch.testing.assert_close(triton_decode.silu_mul(gate_up), want, atol=_tol(dtype),
                               rtol=_tol(dtype))


def _rope_table(size: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """cos and sign-folded sin, `[size, 2, d]`, as `LlamaDecoder._rope_rows` lays them out."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    angles = torch.arange(size, device="cuda").float()[:, None] * inv[None]
    emb = torch.cat([angles, angles], -1)
    sin = emb.sin()
    sin = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], -1)
    return torch.stack([emb.cos(), sin], 1).to(dtype).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(14, 2, 64), (4, 2, 16)])
def test_attention_equals_rope_store_and_the_eager_attention(
    dtype: torch.dtype, heads: int, kv_heads: int, d: int
) -> None:
    """Left-padded rows (some columns masked), a column past the first block: the new key
    and value land in the cache, and the output is the eager step's within tolerance."""
    torch.manual_seed(1)
    rows, capacity, col = 5, 200, 130
    kv = torch.randn(rows, kv_heads, 2, capacity, d, device="cuda", dtype=dtype)
    mask = torch.zeros(rows, capacity, dtype=torch.bool, device="cuda")
    for r in range(rows):
        mask[r, 9 * r : col + 1] = True
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, device="cuda", dtype=dtype)
    positions = mask[:, : col + 1].sum(-1) - 1
    rope = _rope_table(256, d, dtype)
    scale = d**-0.5

    want_kv = kv.clone()
    cos, sin = rope[positions].unbind(1)
    q_k = qkv.view(rows, -1, 1, d)[:, : heads + kv_heads].clone()
    q_k = torch.addcmul(q_k * cos[:, None, None], q_k.roll(d // 2, -1), sin[:, None, None])
    new = torch.cat([q_k[:, heads:], qkv.view(rows, -1, 1, d)[:, heads + kv_heads :]], 1)
    want_kv[:, :, :, col] = new.view(rows, 2, kv_heads, d).transpose(1, 2)
    bias = torch.where(mask[:, None, None, : col + 1], 0.0, float("-inf")).to(dtype)
    keys, values = want_kv[..., : col + 1, :].unbind(2)
    want = _decode_attention(q_k[:, :heads], keys, values, bias, scale).reshape(rows, -1)

    got = triton_decode.attention(qkv, kv, mask, torch.tensor([col], device="cuda"),
                                  positions, rope, heads, kv_heads, scale)
    torch.testing.assert_close(kv, want_kv, atol=_tol(dtype), rtol=_tol(dtype))
    torch.testing.assert_close(got, want, atol=_tol(dtype), rtol=_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["sampled", "mixed", "greedy"])
def test_sampling_is_the_inverse_cdf_draw(dtype: torch.dtype, kind: str) -> None:
    """Over the Qwen2 vocabulary: each sampled token's interval of the (float64) CDF of
    softmax(logits / T) holds the row's uniform, up to float32 rounding; nearly every token
    is the eager `sample_tokens`' (the two sum the CDF in other orders, so a uniform within
    rounding of a step may fall either side); log-probs are its; greedy rows take the first
    largest logit."""
    torch.manual_seed(2)
    rows, vocab = 64, 151_936
    logits = (3 * torch.randn(rows, vocab, device="cuda")).to(dtype)
    logits[0, 7] = logits[0, 11] = logits[0].max() + 1  # a tie: the first index wins
    temps = torch.full((rows,), 0.7, device="cuda")
    if kind == "mixed":
        temps[::3] = 0.0
    if kind == "greedy":
        temps.zero_()
    params = SamplingRows.of(temps, torch.ones(rows, device="cuda"),
                             torch.full((rows,), vocab, device="cuda"), vocab)
    uniform = None if kind == "greedy" else torch.rand(rows, device="cuda")
    want_tok, want_logp = sample_tokens(logits.float(), params, uniform)
    tok, logp = triton_decode.sample(logits, params.divisor, uniform, params.greedy)
    torch.testing.assert_close(logp, want_logp, atol=1e-4, rtol=1e-5)
    greedy = temps <= 0
    assert tok[greedy].tolist() == want_tok[greedy].tolist()
    if uniform is not None:
        divisor = torch.where(greedy, 1.0, temps)[:, None].double()
        cdf = torch.softmax(logits.double() / divisor, -1).cumsum(-1)
        upper = cdf.gather(1, tok[:, None])[:, 0]
        lower = torch.where(tok > 0, cdf.gather(1, (tok - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        u = uniform.double()
        inside = (lower - 1e-5 <= u) & (u <= upper + 1e-5)
        assert bool(inside[~greedy].all())
        assert int((tok == want_tok).sum()) >= rows - 2
