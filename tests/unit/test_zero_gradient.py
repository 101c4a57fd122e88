"""Zero-gradient samples (a GRPO group whose responses all got the same reward, a sample with
no loss-masked token) are left out of the actor's passes: the update is the one the whole
batch gives, for less work."""

from __future__ import annotations

import pytest
import torch

from engines.algorithms.losses import zero_gradient_samples
from engines.config.algorithm import AlgorithmConfig
from engines.train.rollout_prep import steps_without
from storage.sample import Sample
from tests.support.fakes import FakeModel, fake_train_step
from tests.support.samples import make_backend, make_samples


def with_rewards(samples: list[Sample], rewards: list[float]) -> list[Sample]:
    for s, r in zip(samples, rewards, strict=True):
        s.reward = r
    return samples


# Groups of 4: all right, all wrong, mixed, all right (12 zero-gradient samples of 16).
REWARDS = [1.0] * 4 + [0.0] * 4 + [1.0, 0.0, 0.0, 1.0] + [1.0] * 4


def test_which_samples_have_a_zero_gradient() -> None:
    adv = [torch.tensor([0.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([0.0, 0.3]),
           torch.tensor([0.7, 0.7])]
    masks = [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0]),
             torch.tensor([0.0, 0.0])]
    plain = AlgorithmConfig()
    # 0: no advantage; 2: advantage only on an unmasked token; 3: nothing masked
    assert zero_gradient_samples(plain, adv, masks) == {0, 2, 3}
    for other in ({"entropy_coef": 0.01}, {"use_kl_loss": True, "kl_loss_coef": 0.1}):
        # their terms pull every masked token, advantage or not
        assert zero_gradient_samples(AlgorithmConfig.model_validate(other), adv, masks) == {3}
    custom = AlgorithmConfig.model_validate(
        {"loss_type": "custom_loss", "custom_loss_function_path": "m:f"})
    assert zero_gradient_samples(custom, adv, masks) == set()


def test_a_step_left_empty_keeps_its_first_row() -> None:
    assert steps_without([[3, 1, 2], [5, 4], [6]], {1, 5, 4}) == [[3, 2], [5], [6]]


def test_skipped_samples_are_neither_scored_nor_trained() -> None:
    model = FakeModel()
    samples = with_rewards(make_samples(16), REWARDS)
    metrics = fake_train_step(model, global_batch_size=8).train(samples, 0)
    trained = [sorted(i for mb in mbs for i in mb.rows) for _, mbs in model.calls]
    # one step holds the mixed group and a zero one, the other two zero groups: a stand-in
    assert sorted(len(rows) for rows in trained) == [1, 4] and [8, 9, 10, 11] in trained
    assert metrics["zero_gradient_samples"] == 11.0  # never in a forward: all but 5
    # lazy: the first step's rows come from its own forward, the other's are scored first
    assert sum(n for _, n in model.scored) == len(trained[1])

    full = FakeModel()
    metrics_full = fake_train_step(full, global_batch_size=8, skip_zero_gradient_samples=False).train(
        with_rewards(make_samples(16), REWARDS), 0)
    assert "zero_gradient_samples" not in metrics_full
    assert sum(len(mb.rows) for _, mbs in full.calls for mb in mbs) == 16
    for key in ("pg_loss", "loss", "clipfrac"):  # the whole step's values
        assert metrics[key] == pytest.approx(metrics_full[key], abs=1e-7)


@pytest.mark.parametrize("share_prompts", [False, True])
def test_the_torch_backend_learns_the_same_weights(tiny_model_dir: str, share_prompts: bool) -> None:
    """Two epochs of four one-group steps: in each epoch three steps hold a zero-gradient
    group (each trains a lone stand-in, so AdamW still moves on its momentum) and one the
    mixed group."""
    results = []
    for skip in (True, False):
        backend = make_backend(tiny_model_dir, global_batch_size=4, num_epochs_per_rollout=2,
                               share_prompts=share_prompts, skip_zero_gradient_samples=skip)
        for rollout_id in range(2):
            samples = with_rewards(make_samples(16, seed=rollout_id), REWARDS)
            metrics = backend.train(samples, rollout_id)
        weights = torch.cat([p.detach().flatten() for p in backend.model.parameters()])
        results.append((weights, metrics))
    (w_skip, m_skip), (w_full, m_full) = results
    assert 0 < m_skip["zero_gradient_samples"] <= 12.0
    assert not torch.equal(w_full, make_weights(tiny_model_dir))  # it did learn
    torch.testing.assert_close(w_skip, w_full, atol=2e-6, rtol=0)
    for key in ("pg_loss", "clipfrac", "grad_norm"):
        assert m_skip[key] == pytest.approx(m_full[key], abs=1e-5)


def make_weights(model_dir: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return torch.cat([p.detach().flatten() for p in model.parameters()])
