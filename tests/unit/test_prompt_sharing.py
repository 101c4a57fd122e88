"""Shared-prompt batches: one row per prompt gives the padded batch's log-probs, entropies
and gradients (float rounding aside), and the torch backend trains the same with it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.train.batching import build_padded_batch
from engines.train.prompt_sharing import build_shared_prompt_batch, supports_prompt_sharing
from engines.train.torch_models import response_log_probs
from storage.sample import Sample
from tests.support.samples import TOL, assert_trains_the_same, grouped_samples, make_backend


def test_one_row_per_prompt_and_the_mask_by_hand() -> None:
    a = Sample(index=0, group_index=0, tokens=[5, 6, 7, 8], response_length=2, loss_mask=[1, 0])
    b = Sample(index=1, group_index=0, tokens=[5, 6, 9], response_length=1, loss_mask=[1])
    c = Sample(index=2, group_index=1, tokens=[10, 11], response_length=1, loss_mask=[1])
    batch = build_shared_prompt_batch([a, b, c], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [10, 11, 0, 0, 0]]
    assert batch.position_ids is not None and batch.logit_row is not None
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
    # a's tokens 7, 8 are predicted at positions 1 (prompt end) and 2; b's 9 at 1; c's 11 at 0
    assert batch.logit_row.tolist() == [[0, 0], [0, 0], [1, 0]]
    assert batch.logit_index.tolist() == [[1, 2], [1, 0], [0, 0]]
    assert batch.targets.tolist() == [[7, 8], [9, 0], [11, 0]]
    assert batch.loss_mask.tolist() == [[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]]
    mask = batch.attention_mask[0, 0].int().tolist()
    assert mask == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],  # a's first token: the prompt and itself
        [1, 1, 1, 1, 0],
        [1, 1, 0, 0, 1],  # b's token: the prompt and itself, not a's response
    ]
    assert batch.attention_mask[1, 0, 4].int().tolist() == [1, 0, 0, 0, 0]  # padding: prompt
    assert batch.num_tokens == 5 + 2


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_log_probs_entropy_and_gradients_match_the_padded_batch(
    tiny_model_dir: str, entropy_grad: bool
) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert supports_prompt_sharing(model)
    samples = grouped_samples(groups=3, per_group=5)
    results = []
    for build in (build_padded_batch, build_shared_prompt_batch):
        batch = build(samples, 0)
        model.zero_grad()
        lp, ent = response_log_probs(model, batch, temperature=0.8, entropy_grad=entropy_grad)
        loss = (lp * batch.loss_mask).sum() + (ent * batch.loss_mask).sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        mask = batch.response_mask.bool()
        results.append((lp[mask], ent[mask], grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    assert lp0.numel() == sum(s.response_length for s in samples)
    torch.testing.assert_close(lp1, lp0, atol=TOL, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=TOL, rtol=0)
    torch.testing.assert_close(g1, g0, atol=TOL, rtol=1e-4)


def test_eager_attention_is_not_shared(tiny_model_dir: str) -> None:
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager")
    assert not supports_prompt_sharing(eager)


def test_backend_trains_the_same_with_and_without_sharing(tiny_model_dir: str) -> None:
    """Two optimizer steps (the second with stored old log-probs) from one start: same
    metrics and weights whichever way micro-batches are laid out."""
    assert_trains_the_same(tiny_model_dir, {"share_prompts": False}, {"share_prompts": True},
                           max_tokens_per_micro_batch=60)


def test_optimizer_steps_hold_whole_groups(tiny_model_dir: str) -> None:
    samples = grouped_samples(groups=6, per_group=4)  # interleaved: group k at k, k + 6, ...
    backend = make_backend(tiny_model_dir, global_batch_size=8)
    first, second = backend.step.partitions(samples), backend.step.partitions(samples)
    for parts in (first, second):
        assert sorted(i for p in parts for i in p) == list(range(len(samples)))
        assert [len(p) for p in parts] == [8, 8, 8]
        for p in parts:
            groups = [samples[i].group_index for i in p]
            assert all(groups.count(g) == 4 for g in groups)
    assert first != second  # a fresh shuffle per epoch


def test_distinct_prompts_get_the_padded_batch() -> None:
    a = Sample(index=0, group_index=0, tokens=[5, 6, 7], response_length=1, loss_mask=[1])
    b = Sample(index=1, group_index=1, tokens=[8, 9, 10], response_length=2, loss_mask=[1, 1])
    batch = build_shared_prompt_batch([a, b], pad_token_id=0)
    assert batch.position_ids is None and batch.attention_mask.dim() == 2
    assert batch.input_ids.tolist() == build_padded_batch([a, b], 0).input_ids.tolist()


def test_prompts_are_shared_by_default_on_the_cpu_only(tiny_model_dir: str) -> None:
    """`train.share_prompts` unset: on for a CPU trainer (a GPU's flash kernels need causal
    padded rows, see the field's description); an explicit setting wins."""
    assert make_backend(tiny_model_dir).shares_prompts
    assert not make_backend(tiny_model_dir, share_prompts=False).shares_prompts
    backend = make_backend(tiny_model_dir)
    backend.device = torch.device("cuda")  # as a GPU trainer resolves it; nothing runs there
    assert not backend.shares_prompts
