"""`train.chunked_lm_head`: the LM head a chunk of tokens at a time gives the whole head's
log-probs, entropies and gradients (float rounding aside), never projects more than a chunk
at once, and trains the same through the torch backend."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from engines.train import chunked_head
from engines.train.batching import build_padded_batch
from engines.train.chunked_head import head_token_stats, output_head, rows_per_chunk
from engines.train.token_stats import token_stats
from engines.train.torch_models import response_log_probs
from flows.config.run import TrainConfig
from tests.support.samples import TOL, assert_trains_the_same, grouped_samples


def _grads(*tensors: torch.Tensor) -> list[torch.Tensor]:
    out = [t.grad.clone() for t in tensors if t.grad is not None]
    for t in tensors:
        t.grad = None
    return out


def test_chunks_give_the_whole_heads_values_and_gradients(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3, 11, 16, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False, dtype=torch.float64)
    targets = torch.randint(0, 50, (3, 11))
    projected: list[int] = []
    real = chunked_head.flat_row_stats

    def spy(flat: torch.Tensor, *args: object) -> torch.Tensor:
        projected.append(flat.shape[0])
        return real(flat, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(chunked_head, "flat_row_stats", spy)
    lp, ent = head_token_stats(hidden, head, targets, 0.7, entropy_grad=True,
                               chunk_bytes=4 * 50 * 8)  # 4 rows of float64 logits
    assert projected == [4] * 8 + [1]  # 33 tokens, never more than a chunk's logits at once
    (lp.sum() + 0.3 * ent.sum()).backward()
    chunked = [lp.detach(), ent.detach(), *_grads(hidden, head.weight)]

    whole_lp, whole_ent = token_stats(hidden @ head.weight.T, targets, 0.7)
    (whole_lp.sum() + 0.3 * whole_ent.sum()).backward()
    whole = [whole_lp.detach(), whole_ent.detach(), *_grads(hidden, head.weight)]
    assert len(chunked) == len(whole) == 4
    for a, b in zip(chunked, whole, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_the_entropy_is_a_metric_unless_it_is_in_the_loss() -> None:
    hidden = torch.randn(5, 8, requires_grad=True)
    head = torch.nn.Linear(8, 20, bias=False)
    targets = torch.randint(0, 20, (5,))
    _, ent = head_token_stats(hidden, head, targets, 1.0, entropy_grad=False)
    assert not ent.requires_grad
    _, ent = head_token_stats(hidden, head, targets, 1.0, entropy_grad=True)
    assert ent.requires_grad


def test_a_model_gives_the_unchunked_log_probs_and_gradients(tiny_model_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    names = list(model.state_dict())
    batch = build_padded_batch(grouped_samples(groups=3, per_group=4), 0)
    results = []
    for chunked in (False, True):
        model.zero_grad()
        lp, ent = response_log_probs(model, batch, 0.8, entropy_grad=True, chunked_head=chunked)
        mask = batch.loss_mask
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp[mask.bool()], ent[mask.bool()], grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=TOL, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=TOL, rtol=0)
    assert g1.keys() == g0.keys() and output_head(model).weight.grad is not None
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=TOL, rtol=1e-4, msg=name)
    # the head is the model's own again: its forward projects, the names are the HF ones
    assert "forward" not in vars(output_head(model))
    assert list(model.state_dict()) == names
    out = model(input_ids=batch.input_ids[:1, :4])
    assert out.logits.shape[-1] == model.config.vocab_size


def test_backend_trains_the_same_chunked(tiny_model_dir: str) -> None:
    """Two optimizer steps from one start: the same metrics and weights either way."""
    whole, chunked = assert_trains_the_same(tiny_model_dir, {"chunked_lm_head": False},
                                            {"chunked_lm_head": True},
                                            max_tokens_per_micro_batch=40)
    samples = grouped_samples(groups=4, per_group=4, seed=1)[:3]  # (the trained ones)
    for a, b in zip(chunked.compute_log_probs(samples), whole.compute_log_probs(samples),
                    strict=True):
        assert a == pytest.approx(b, abs=1e-5)


def test_chunk_rows_follow_the_byte_budget() -> None:
    assert rows_per_chunk(151_936, torch.bfloat16) == (1 << 29) // (151_936 * 2)
    assert rows_per_chunk(151_936, torch.float32, chunk_bytes=1) == 1


def test_only_the_torch_trainer_has_it() -> None:
    with pytest.raises(ValidationError, match="chunked_lm_head is the torch trainer's"):
        TrainConfig(backend="megatron", chunked_lm_head=True)
