"""Sequence packing: packed rows give the padded batch's log-probs, entropies and gradients
(float rounding aside), and the torch backend trains the same with `pack_sequences`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.train.batching import build_padded_batch, split_micro_batches
from engines.train.packing import build_packed_batch, first_fit, row_width
from engines.train.torch_models import response_log_probs
from storage.sample import Sample
from tests.support.samples import TOL, assert_trains_the_same, grouped_samples, make_backend


def _sample(index: int, group: int, tokens: list[int], r: int) -> Sample:
    return Sample(index=index, group_index=group, tokens=tokens, response_length=r,
                  loss_mask=[1] * r)


def test_packed_rows_and_mask_by_hand() -> None:
    a = _sample(0, 0, [5, 6, 7, 8], 2)  # 4 tokens: a row of its own
    b = _sample(1, 1, [9, 10], 1)
    c = _sample(2, 2, [11, 12], 1)  # b and c share the second row
    batch = build_packed_batch([a, b, c], pad_token_id=0, share_prompts=False)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert batch.position_ids is not None and batch.logit_row is not None
    assert batch.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1]]
    assert batch.logit_row.tolist() == [[0, 0], [1, 0], [1, 0]]
    assert batch.logit_index.tolist() == [[1, 2], [0, 0], [2, 0]]
    assert batch.targets.tolist() == [[7, 8], [10, 0], [12, 0]]
    assert batch.attention_mask[1, 0].int().tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [0, 0, 1, 0],  # c starts afresh: b is another sequence
        [0, 0, 1, 1],
    ]
    assert batch.num_tokens == 8 and batch.cu_seqlens is None


def test_varlen_batch_is_one_row_of_real_tokens() -> None:
    a, b = _sample(0, 0, [5, 6, 7], 1), _sample(1, 0, [5, 6, 9, 4, 3], 3)
    batch = build_packed_batch([a, b], pad_token_id=0, varlen=True)  # no prompt sharing
    assert batch.input_ids.tolist() == [[5, 6, 7, 5, 6, 9, 4, 3]]
    assert batch.cu_seqlens is not None and batch.cu_seqlens.tolist() == [0, 3, 8]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.position_ids is not None
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert batch.logit_index.tolist() == [[1, 0, 0], [4, 5, 6]]
    assert batch.num_tokens == 8


def test_first_fit_and_the_packed_budget() -> None:
    assert first_fit([5, 2, 3, 4, 1], 5) == [[0], [3, 4], [2, 1]]
    assert first_fit([7, 2], 5) == [[0], [1]]  # oversize item alone
    # padded budget: 3 * 9 > 20 splits [9, 8, 3]; packed budget counts 9 + 8 + 3 = 20
    assert split_micro_batches([9, 8, 3, 4], 20) == [[0, 1], [3, 2]]
    assert split_micro_batches([9, 3, 8], 20, packed=True) == [[0, 2, 1]]
    assert split_micro_batches([9, 8, 4], 20, packed=True) == [[0, 1], [2]]
    # groups (shared prompts): a group's samples stay adjacent, groups by their longest
    groups = [0, 1, 0, 1, 2]
    assert split_micro_batches([3, 9, 8, 4, 5], 20, groups=groups) == [[1, 3], [2, 0], [4]]
    assert split_micro_batches([3, 9, 8, 4, 5], 12, True, groups) == [[1], [3, 2], [0, 4]]


def test_row_width_weighs_padding_against_attention() -> None:
    lengths = [10, 6, 5, 4]
    assert row_width(lengths, hidden_size=1) == 10  # attention dominates: no wider rows
    # wide model: matmuls dominate, so fewer padded slots win (one row of 25, 2.5x longest)
    assert row_width(lengths, hidden_size=10_000) == 30
    assert row_width([7], hidden_size=64) == 7


@pytest.mark.parametrize("share_prompts", [False, True])
def test_log_probs_entropy_and_gradients_match_the_padded_batch(
    tiny_model_dir: str, share_prompts: bool
) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    samples = grouped_samples(groups=3, per_group=5)
    results = []
    for packed in (False, True):
        batch = (build_packed_batch(samples, 0, share_prompts) if packed
                 else build_padded_batch(samples, 0))
        model.zero_grad()
        lp, ent = response_log_probs(model, batch, temperature=0.8, entropy_grad=True)
        loss = (lp * batch.loss_mask).sum() + (ent * batch.loss_mask).sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        mask = batch.response_mask.bool()
        results.append((batch.input_ids.numel(), lp[mask], ent[mask], grads))
    (n0, lp0, ent0, g0), (n1, lp1, ent1, g1) = results
    assert n1 < n0  # computed token slots: packed rows pad only their tails
    torch.testing.assert_close(lp1, lp0, atol=TOL, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=TOL, rtol=0)
    torch.testing.assert_close(g1, g0, atol=TOL, rtol=1e-4)


@pytest.mark.parametrize("share", [False, True])
def test_backend_trains_the_same_packed_and_padded(tiny_model_dir: str, share: bool) -> None:
    """Two optimizer steps from one start: the same metrics and weights packed or padded."""
    assert_trains_the_same(tiny_model_dir, {"share_prompts": False, "pack_sequences": False},
                           {"share_prompts": share, "pack_sequences": True},
                           max_tokens_per_micro_batch=40)


def test_packing_needs_sdpa(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import engines.train.torch_backend as tb

    monkeypatch.setattr(tb, "supports_prompt_sharing", lambda model: False)  # e.g. eager
    with pytest.raises(ValueError, match="pack_sequences needs a model on sdpa"):
        make_backend(tiny_model_dir, pack_sequences=True)


def test_varlen_attention_is_block_diagonal_causal() -> None:
    """megatron's packed core attention (here its per-sequence fallback, CPU) against SDPA
    under the block-diagonal causal mask of the same sequences, with GQA."""
    from engines.train.megatron.model import varlen_causal_attention

    torch.manual_seed(0)
    cu = torch.tensor([0, 3, 10, 11, 16], dtype=torch.int32)
    q, k, v = (torch.randn(16, h, 8) for h in (4, 2, 2))
    out = varlen_causal_attention(q, k, v, cu, 7)
    seq = torch.repeat_interleave(torch.arange(4), cu[1:] - cu[:-1])
    mask = (seq[:, None] == seq[None, :]) & torch.ones(16, 16, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
