"""Sequence packing on megatron (`train.pack_sequences`): one varlen row per micro-batch
gives the padded batches' log-probs, losses and weights (1 GPU)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from flows.config.run import AlgorithmConfig, TrainConfig
from storage.sample import Sample
from tests.support.gpu import grpo_samples

pytestmark = pytest.mark.gpu


def _cfgs(
    path: str, dtype: str, pack: bool, algo: dict[str, Any] | None = None,
) -> tuple[TrainConfig, AlgorithmConfig]:
    train = TrainConfig(model_path=path, lr=1e-3, dtype=dtype, global_batch_size=8,
                        max_tokens_per_micro_batch=64, seed=7, pack_sequences=pack)
    return train, AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01,
                                  **(algo or {}))


def _longtail_samples(seed: int = 5, vocab: int = 256) -> list[Sample]:
    """Groups whose responses differ in length up to 40x (1 to 40 tokens), so a packed
    micro-batch's longest response is several times its mean; one masked token per group."""
    rng = random.Random(seed)
    out = []
    for g in range(4):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 9))]
        lengths = [40, 1, 3, 2] if g == 0 else [rng.choice([1, 2, 5, 30]) for _ in range(4)]
        for j, n in enumerate(lengths):
            mask = [0 if (j, k) == (0, 0) else 1 for k in range(n)]
            out.append(Sample(index=len(out), group_index=g,
                              tokens=prompt + [rng.randrange(1, vocab) for _ in range(n)],
                              response_length=n, loss_mask=mask,
                              reward=float(rng.random() > 0.5)))
    return out


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_varlen_attention_matches_per_sequence_sdpa(heads: tuple[int, int]) -> None:
    """The flash varlen kernel (bf16) against SDPA run on each sequence alone, GQA too,
    outputs and gradients."""
    from engines.train.megatron.model import varlen_causal_attention

    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 37, 38, 100], dtype=torch.int32)
    hq, hkv = heads
    q, k, v = (torch.randn(100, h, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (hq, hkv, hkv))
    out = varlen_causal_attention(q, k, v, cu, 62)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    ref = varlen_causal_attention(q.float(), k.float(), v.float(), cu, 62)  # per-sequence SDPA
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.float(), r.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rope_is_megatrons_bit_for_bit(dtype: torch.dtype, interleaved: bool) -> None:
    """`rope.packed_rope` (one pass) against megatron's per-sequence thd RoPE on the GPU:
    equal outputs and gradients, ragged lengths, megatron's own angle table."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from engines.train.megatron.rope import packed_rope

    class OneRank:  # context parallel size 1, all megatron asks of the group
        def size(self) -> int:
            return 1

        def rank(self) -> int:
            return 0

    torch.manual_seed(0)
    lengths = [5, 300, 1, 62, 2048]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    freqs = RotaryEmbedding(kv_channels=64, rotary_percent=1.0, rotary_interleaved=interleaved,
                            rotary_base=1000000).get_emb(max(lengths))
    t = torch.randn(sum(lengths), 4, 64, device="cuda", dtype=dtype, requires_grad=True)
    ref = _apply_rotary_pos_emb_thd(t, cu, freqs, rotary_interleaved=interleaved,
                                    cp_group=OneRank())
    out = packed_rope(t, cu, freqs, interleaved)
    g = torch.randn_like(out)
    assert torch.equal(out, ref)
    assert torch.equal(torch.autograd.grad(out, t, g)[0], torch.autograd.grad(ref, t, g)[0])


CASES = {  # name: (dtype, samples, algorithm overrides)
    "float32": ("float32", "grpo", None),
    "bfloat16": ("bfloat16", "grpo", None),
    # micro-batches mixing long and very short responses; PPO trains the critic (values) too
    "float32 longtail ppo": ("float32", "longtail", {"advantage_estimator": "ppo"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_trains_as_padded(qwen2_tiny_dir: str, case: str) -> None:
    """Log-probs, then two optimizer steps from identical weights, packed vs padded."""
    from engines.train.megatron import MegatronTrainBackend

    dtype, kind, algo = CASES[case]
    samples = grpo_samples(seed=11) if kind == "grpo" else _longtail_samples()
    padded = MegatronTrainBackend(*_cfgs(qwen2_tiny_dir, dtype, False, algo))
    packed = MegatronTrainBackend(*_cfgs(qwen2_tiny_dir, dtype, True, algo))
    tol = 1e-4 if dtype == "float32" else 5e-2  # bf16 logits: 1 ulp at |logit| ~ 4 is 0.03
    for a, b in zip(padded.compute_log_probs(samples), packed.compute_log_probs(samples),
                    strict=True):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=tol, rtol=0)
    keys = ["loss", "pg_loss", "kl_loss", "entropy"]
    keys += ["critic/value_loss"] if algo else []
    for step in range(2):
        m, p = padded.train(samples, step), packed.train(samples, step)
        print(f"packing {case} step {step}: loss {p['loss']!r} vs {m['loss']!r}, "
              f"grad_norm {p['grad_norm']!r} vs {m['grad_norm']!r}")
        for key in keys:
            assert p[key] == pytest.approx(m[key], abs=tol), (case, step, key)
        for key in ["grad_norm"] + (["critic/grad_norm"] if algo else []):
            assert p[key] == pytest.approx(m[key], rel=1e-3 if tol < 1e-3 else 5e-2), key
    wa, wb = padded.export_weights(), packed.export_weights()
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)
    print(f"packing {case}: weights after 2 steps max |diff| {worst:.3e}")
    if dtype == "float32":  # bf16 weights: one rounding flip near 1.0 is 8e-3, > 2 steps' lr
        assert worst <= 5e-5, worst  # Adam near-zero grads: see test_prompt_sharing
