"""Pure algorithm functions against numbers worked out by hand (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from engines.algorithms.advantages import grpo_advantages, grpo_advantages_by_group
from engines.algorithms.losses import (
    LossInputs,
    actor_loss,
    entropy_from_logits,
    kl_penalty,
    masked_mean_per_sample,
    masked_mean_per_token,
    policy_loss,
    sft_loss,
)
from flows.config import AlgorithmConfig

SQRT_1_3 = math.sqrt(1.0 / 3.0)


# -- advantages ---------------------------------------------------------------------------
def test_grpo_advantages_2x3_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0], [3.0, 1.0, 2.0]])
    # group 0: mean 1/3 -> centred (2/3, -1/3, -1/3);
    #          unbiased var = (4/9 + 1/9 + 1/9) / (3 - 1) = 1/3 -> std = sqrt(1/3)
    # group 1: mean 2 -> centred (1, -1, 0); unbiased var = (1 + 1 + 0) / 2 = 1 -> std = 1
    eps = 1e-6
    expected = torch.tensor(
        [
            [(2 / 3) / (SQRT_1_3 + eps), (-1 / 3) / (SQRT_1_3 + eps), (-1 / 3) / (SQRT_1_3 + eps)],
            [1 / (1 + eps), -1 / (1 + eps), 0.0],
        ]
    )
    got = grpo_advantages(rewards)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert got[0, 0].item() == pytest.approx(1.1547, abs=1e-4)  # 2/3 * sqrt(3)


def test_grpo_without_std_is_dr_grpo_and_constant_group_is_zero() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    torch.testing.assert_close(
        grpo_advantages(rewards, std_normalization=False),
        torch.tensor([[2 / 3, -1 / 3, -1 / 3], [0.0, 0.0, 0.0]]),
    )
    # std 0: centred 0 / (0 + eps) = 0, never NaN
    assert torch.equal(grpo_advantages(rewards)[1], torch.zeros(3))


def test_grpo_by_group_handles_order_sizes_and_singletons() -> None:
    # interleaved groups 7 and 9, plus a single-sample group 4
    rewards = [1.0, 10.0, 3.0, 30.0, 5.0]
    groups = [7, 9, 7, 9, 4]
    # group 7: (1, 3) mean 2 -> (-1, 1), unbiased std = sqrt((1 + 1) / 1) = sqrt(2)
    # group 9: (10, 30) mean 20 -> (-10, 10), std = sqrt(200) = 10 sqrt(2)
    # group 4: one sample -> centred 0, no std division
    s2 = math.sqrt(2.0)
    expected = torch.tensor([-1 / s2, -1 / s2, 1 / s2, 1 / s2, 0.0])
    torch.testing.assert_close(
        grpo_advantages_by_group(rewards, groups), expected, atol=1e-5, rtol=0
    )
    no_std = grpo_advantages_by_group(rewards, groups, std_normalization=False)
    torch.testing.assert_close(no_std, torch.tensor([-1.0, -10.0, 1.0, 10.0, 0.0]))


# -- policy loss --------------------------------------------------------------------------
def _ratios_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # old log-prob 0, so ratio = exp(log_prob); one token per row
    ratios = torch.tensor([1.5, 0.5, 0.5, 1.5, 1.1, 1.25])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0])
    return ratios.log().unsqueeze(-1), torch.zeros(6, 1), adv.unsqueeze(-1)


def test_policy_loss_clips_both_sides_by_hand() -> None:
    log_probs, old, adv = _ratios_case()
    mask = torch.ones(6, 1)
    loss, clipfrac, approx_kl = policy_loss(log_probs, old, adv, mask, 0.2, 0.28)
    # loss = max(-r A, -clip(r, 0.8, 1.28) A)
    # r=1.5  A=+1: max(-1.5, -1.28) = -1.28  clipped (high side)
    # r=0.5  A=-1: max( 0.5,  0.8 ) =  0.8   clipped (low side)
    # r=0.5  A=+1: max(-0.5, -0.8 ) = -0.5   not clipped (pessimistic branch is unclipped)
    # r=1.5  A=-1: max( 1.5,  1.28) =  1.5   not clipped
    # r=1.1  A=+1: -1.1 inside the trust region
    # r=1.25 A=+1: -1.25, inside [0.8, 1.28] thanks to clip-higher
    expected = torch.tensor([-1.28, 0.8, -0.5, 1.5, -1.1, -1.25]).unsqueeze(-1)
    torch.testing.assert_close(loss, expected)
    assert clipfrac.squeeze(-1).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    # approx_kl is slime's ppo_kl = old - new = -log r
    torch.testing.assert_close(approx_kl, -log_probs)


def test_policy_loss_symmetric_clip_by_default() -> None:
    log_probs, old, adv = _ratios_case()
    loss, clipfrac, _ = policy_loss(log_probs, old, adv, torch.ones(6, 1), 0.2)
    # without clip-higher, r=1.25 A=+1 is clipped to -1.2 and r=1.5 A=+1 to -1.2
    assert loss[5].item() == pytest.approx(-1.2)
    assert loss[0].item() == pytest.approx(-1.2)
    assert clipfrac[5].item() == 1.0


def test_masked_tokens_contribute_nothing_even_to_gradients() -> None:
    # second token is masked and holds garbage (a huge log-prob -> ratio = inf)
    log_probs = torch.tensor([[math.log(1.1), 80.0]], requires_grad=True)
    old = torch.zeros(1, 2)
    adv = torch.tensor([[2.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, clipfrac, kl = policy_loss(log_probs, old, adv, mask, 0.2)
    assert loss[0, 1].item() == 0.0 and clipfrac[0, 1].item() == 0.0 and kl[0, 1].item() == 0.0
    total = masked_mean_per_sample(loss, mask)
    total.backward()
    assert log_probs.grad is not None
    # d(-r A)/d log_prob = -r A = -1.1 * 2 on the real token; exactly 0 on the masked one
    assert log_probs.grad[0, 0].item() == pytest.approx(-2.2, rel=1e-5)
    assert log_probs.grad[0, 1].item() == 0.0
    assert total.item() == pytest.approx(-2.2, rel=1e-5)


# -- KL -----------------------------------------------------------------------------------
def test_kl_estimators_by_hand() -> None:
    lp = torch.tensor([0.0])
    ref = torch.tensor([math.log(2.0)])  # log r = lp - ref = -ln 2
    ln2 = math.log(2.0)
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(-ln2)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(ln2**2 / 2)  # 0.2402
    # k3 = exp(-log r) - 1 + log r = 2 - 1 - ln 2 = 0.3069
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(1 - ln2)
    assert kl_penalty(lp, ref, "low_var_kl").item() == pytest.approx(1 - ln2)
    # far from the reference: k3 = e^20 - 21 ~ 4.85e8, low_var_kl is clamped to 10
    far = torch.tensor([20.0])
    assert kl_penalty(lp, far, "k3").item() == pytest.approx(math.exp(20) - 21, rel=1e-5)
    assert kl_penalty(lp, far, "low_var_kl").item() == 10.0
    with pytest.raises(ValueError, match="unknown KL"):
        kl_penalty(lp, ref, "k4")


# -- reductions, SFT, entropy ----------------------------------------------------------------
def test_reductions_by_hand() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # per sample: (1+2)/2 = 1.5, 4/1 = 4, empty sample -> 0; mean over 3 samples = 5.5/3
    assert masked_mean_per_sample(x, mask).item() == pytest.approx(5.5 / 3)
    # as part of a global batch of 5 samples
    assert masked_mean_per_sample(x, mask, num_samples=5).item() == pytest.approx(5.5 / 5)
    # per token: (1 + 2 + 4) / 3 tokens
    assert masked_mean_per_token(x, mask).item() == pytest.approx(7 / 3)
    assert masked_mean_per_token(x, mask, num_tokens=7).item() == pytest.approx(1.0)


def test_sft_loss_and_entropy_by_hand() -> None:
    lp = torch.tensor([[-0.5, -2.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    torch.testing.assert_close(sft_loss(lp, mask), torch.tensor([[0.5, 2.0, 0.0]]))
    assert masked_mean_per_sample(sft_loss(lp, mask), mask).item() == pytest.approx(1.25)
    # uniform over 4 -> ln 4; p = (3/4, 1/4) from logits (ln 3, 0) -> -(.75 ln .75 + .25 ln .25)
    ent = entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0]]))
    assert ent.item() == pytest.approx(math.log(4))
    ent2 = entropy_from_logits(torch.tensor([math.log(3.0), 0.0]))
    assert ent2.item() == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))


# -- the combined actor loss ------------------------------------------------------------------
def _inputs(rows: slice | None = None) -> LossInputs:
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 3, generator=g)
    t = LossInputs(
        log_probs=lp,
        loss_mask=torch.tensor(
            [[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]
        ),
        entropy=torch.rand(4, 3, generator=g),
        old_log_probs=lp + 0.3 * (torch.rand(4, 3, generator=g) - 0.5),
        advantages=torch.tensor([[1.0], [-1.0], [0.5], [-0.5]]),
        ref_log_probs=lp + 0.1,
    )
    if rows is None:
        return t
    return LossInputs(**{k: getattr(t, k)[rows] for k in t.__dataclass_fields__})


def test_actor_loss_combines_terms_like_slime() -> None:
    algo = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.5, entropy_coef=0.01, kl_loss_type="k1")
    loss, terms = actor_loss(algo, _inputs(), denominator=4)
    expected = terms["pg_loss"] - 0.01 * terms["entropy"] + 0.5 * terms["kl_loss"]
    assert loss.item() == pytest.approx(expected.item())
    # k1 with ref = lp + 0.1 is -0.1 on every token, whatever the reduction
    assert terms["kl_loss"].item() == pytest.approx(-0.1, rel=1e-5)


@pytest.mark.parametrize("per_token", [False, True])
def test_actor_loss_is_additive_over_micro_batches(per_token: bool) -> None:
    algo = AlgorithmConfig(calculate_per_token_loss=per_token, use_kl_loss=True, kl_loss_coef=0.1)
    full = _inputs()
    denom = float(full.loss_mask.sum()) if per_token else 4.0
    whole, _ = actor_loss(algo, full, denom)
    parts = [actor_loss(algo, _inputs(s), denom)[0] for s in (slice(0, 1), slice(1, 4))]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-7)


def test_sft_actor_loss_ignores_advantages() -> None:
    algo = AlgorithmConfig(loss_type="sft_loss")
    inputs = _inputs()
    loss, terms = actor_loss(algo, inputs, denominator=4)
    assert loss.item() == pytest.approx(
        masked_mean_per_sample(-inputs.log_probs, inputs.loss_mask).item()
    )
    assert terms["clipfrac"].item() == 0.0
