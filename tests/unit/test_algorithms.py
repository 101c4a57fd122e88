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
from flows.config.run import AlgorithmConfig

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
    fields = {k: getattr(t, k) for k in t.__dataclass_fields__}
    return LossInputs(**{k: v if v is None else v[rows] for k, v in fields.items()})  # type: ignore[arg-type]


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


# -- more estimators (engines/algorithms/advantages.py, registry.py) ------------------------
from engines.algorithms.advantages import (  # noqa: E402
    gae,
    masked_whiten,
    ppo_token_rewards,
    reinforce_plus_plus_returns,
    rloo_advantages_by_group,
)
from engines.algorithms.losses import (  # noqa: E402
    critic_loss,
    gspo_kl,
    policy_loss_from_kl,
    value_loss,
)
from engines.algorithms.registry import (  # noqa: E402
    ADVANTAGE_ESTIMATORS,
    AdvantageInputs,
    compute_advantages,
    load_estimator,
)
from engines.hooks.loader import HookError  # noqa: E402
from engines.train.lr_schedule import lr_at  # noqa: E402


def test_rloo_leaves_one_out() -> None:
    # group 0 = (1, 0, 0): A_0 = 1 - mean(0, 0) = 1; A_1 = 0 - mean(1, 0) = -0.5; same A_2
    # group 5 = (4,) alone: no other sample -> 0
    got = rloo_advantages_by_group(torch.tensor([1.0, 0.0, 0.0, 4.0]), [0, 0, 0, 5])
    torch.testing.assert_close(got, torch.tensor([1.0, -0.5, -0.5, 0.0]))


def test_reinforce_plus_plus_returns_by_hand() -> None:
    # token rewards = -0.5 * kl = (-0.05, -0.1, -0.15); reward 1 on the last *masked* token
    # (index 1): (-0.05, 0.9, -0.15). gamma 0.9, from the end:
    # G2 = -0.15; G1 = 0.9 + 0.9 * -0.15 = 0.765; G0 = -0.05 + 0.9 * 0.765 = 0.6385
    got = reinforce_plus_plus_returns(
        1.0, torch.tensor([0.1, 0.2, 0.3]), torch.tensor([1.0, 1.0, 0.0]), 0.5, 0.9
    )
    torch.testing.assert_close(got, torch.tensor([0.6385, 0.765, -0.15]))
    with pytest.raises(ValueError, match="no loss-masked token"):
        reinforce_plus_plus_returns(1.0, torch.zeros(2), torch.zeros(2), 0.5, 0.9)


def test_gae_by_hand() -> None:
    # rewards (0, 0, 1), values (0.5, 0.6, 0.7), gamma 1, lambda 0.5, V_3 = 0
    # d2 = 1 - 0.7 = 0.3            A2 = 0.3
    # d1 = 0.7 - 0.6 = 0.1          A1 = 0.1 + 0.5 * 0.3 = 0.25
    # d0 = 0.6 - 0.5 = 0.1          A0 = 0.1 + 0.5 * 0.25 = 0.225
    adv, ret = gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.6, 0.7]), 1.0, 0.5)
    torch.testing.assert_close(adv, torch.tensor([0.225, 0.25, 0.3]))
    torch.testing.assert_close(ret, torch.tensor([0.725, 0.85, 1.0]))  # A + V
    # PPO token rewards: -kl_coef * kl, reward added on the last token
    torch.testing.assert_close(
        ppo_token_rewards(1.0, torch.full((3,), 0.2), 0.5), torch.tensor([-0.1, -0.1, 0.9])
    )


def test_masked_whiten_by_hand() -> None:
    # masked tokens 1, 2, 3: mean 2, population var (1 + 0 + 1) / 3 = 2/3
    out = masked_whiten(
        [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 100.0])],
        [torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])],
    )
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(torch.cat(out), torch.tensor([-1 / s, 0.0, 1 / s, 98 / s]))


def _adv_inputs(**kw: object) -> AdvantageInputs:
    base: dict[str, object] = {
        "rewards": torch.tensor([1.0, 0.0]),
        "group_indices": [0, 0],
        "loss_masks": [torch.ones(2), torch.ones(2)],
        "kl": [torch.tensor([0.2, 0.4]), torch.zeros(2)],
    }
    base.update(kw)
    return AdvantageInputs(**base)  # type: ignore[arg-type]


def test_registry_estimators_by_hand() -> None:
    assert set(ADVANTAGE_ESTIMATORS) == {
        "grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"
    }
    x = _adv_inputs()
    # reinforce++ baseline: r - mean = (0.5, -0.5), minus 0.5 * kl per token
    algo = AlgorithmConfig(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.5)
    res = compute_advantages(algo, x)
    torch.testing.assert_close(res.advantages[0], torch.tensor([0.4, 0.3]))
    torch.testing.assert_close(res.advantages[1], torch.tensor([-0.5, -0.5]))
    # Dr.GRPO broadcasts (0.5, -0.5) to every token; grpo divides by std sqrt(0.5)
    dr = compute_advantages(AlgorithmConfig(grpo_std_normalization=False), x)
    assert dr.advantages[0].tolist() == [0.5, 0.5]
    g = compute_advantages(AlgorithmConfig(), x)
    assert g.advantages[1][0].item() == pytest.approx(-0.5 / (math.sqrt(0.5) + 1e-6))
    with pytest.raises(ValueError, match="critic values"):
        compute_advantages(AlgorithmConfig(advantage_estimator="ppo"), x)


def test_reinforce_plus_plus_gives_a_removed_sample_nothing_to_learn() -> None:
    """A response whose loss mask rollout.sample_filter_path zeroed gets zero returns; its
    group mate keeps its own (the pure return function still refuses such a response)."""
    x = _adv_inputs(loss_masks=[torch.ones(2), torch.zeros(2)])
    res = compute_advantages(AlgorithmConfig(advantage_estimator="reinforce_plus_plus",
                                             kl_coef=0.5, gamma=1.0), x)
    torch.testing.assert_close(res.advantages[0], torch.tensor([0.7, 0.8]))
    assert res.advantages[1].tolist() == [0.0, 0.0]


def test_on_policy_distillation_subtracts_reverse_kl() -> None:
    # grpo on (1, 0): A = +-0.5 / (sqrt(0.5) + eps) ~ +-0.7071 on every token
    # sample 0: student (-1, -2), teacher (-0.5, -2.5) -> reverse KL (-0.5, 0.5)
    x = _adv_inputs(
        log_probs=[torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])],
        teacher_log_probs=[torch.tensor([-0.5, -2.5]), torch.tensor([-1.0, -1.0])],
    )
    algo = AlgorithmConfig(use_opd=True, opd_kl_coef=1.0, opd_teacher_path="t")
    res = compute_advantages(algo, x)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(res.advantages[0], torch.tensor([a + 0.5, a - 0.5]))
    torch.testing.assert_close(res.advantages[1], torch.tensor([-a, -a]))
    assert res.opd_reverse_kl is not None and res.opd_reverse_kl[0].tolist() == [-0.5, 0.5]


def _hook_advantages(algo: AlgorithmConfig, x: AdvantageInputs) -> tuple[list, list]:
    adv = [torch.full_like(m, 7.0) for m in x.loss_masks]
    return adv, adv


def _hook_loss(algo: AlgorithmConfig, inputs: LossInputs, denominator: float) -> tuple:
    loss = -(inputs.log_probs * inputs.loss_mask).sum() / denominator
    return loss, {"loss": loss.detach()}


def test_custom_advantage_hook_by_import_string() -> None:
    algo = AlgorithmConfig(
        custom_advantage_function_path="tests.unit.test_algorithms:_hook_advantages"
    )
    assert compute_advantages(algo, _adv_inputs()).advantages[1].tolist() == [7.0, 7.0]
    bad = AlgorithmConfig(custom_advantage_function_path="tests.unit.test_algorithms:nope")
    with pytest.raises(HookError, match="custom_advantage_function_path"):
        load_estimator(bad)
    only_advantages = AlgorithmConfig(
        custom_advantage_function_path="tests.unit.test_algorithms:_hook_advantages_only")
    with pytest.raises(HookError, match=r"^algorithm.custom_advantage_function_path: tests.unit."
                       r"test_algorithms:_hook_advantages_only returned list .*, expected a pair"):
        compute_advantages(only_advantages, _adv_inputs())


def _hook_advantages_only(algo: AlgorithmConfig, x: AdvantageInputs) -> list:
    return [torch.full_like(m, 7.0) for m in x.loss_masks][:1]  # no returns, and one row short


def _hook_one_row_short(algo: AlgorithmConfig, x: AdvantageInputs) -> tuple[list, list]:
    adv = [torch.full_like(m, 7.0) for m in x.loss_masks][1:]
    return adv, adv


def test_a_custom_advantage_with_too_few_rows_is_reported_at_once() -> None:
    """Rows missing from a custom estimator's result come back the same on a retry: a
    HookError naming the hook, which the step task does not retry."""
    from prefect.states import Failed

    from tasks.retries import retry_transient

    path = "tests.unit.test_algorithms:_hook_one_row_short"
    with pytest.raises(HookError) as raised:
        compute_advantages(AlgorithmConfig(custom_advantage_function_path=path), _adv_inputs())
    assert str(raised.value) == f"advantage estimator {path} returned 1 rows for 2 samples"
    assert retry_transient(None, None, Failed(data=raised.value)) is False


# -- more loss options --------------------------------------------------------------------
def test_dual_clip_caps_negative_advantages() -> None:
    # ratio 3 (ppo_kl = -ln 3), eps 0.2:
    # A = -1: max(3, 1.2) = 3, dual clip with c = 2 -> min(3, 2) = 2
    # A = +1: max(-3, -1.2) = -1.2, untouched by dual clip
    ppo_kl = torch.full((2, 1), -math.log(3.0))
    adv = torch.tensor([[-1.0], [1.0]])
    loss, _ = policy_loss_from_kl(ppo_kl, adv, torch.ones(2, 1), 0.2, eps_clip_c=2.0)
    torch.testing.assert_close(loss, torch.tensor([[2.0], [-1.2]]))
    no_dual, _ = policy_loss_from_kl(ppo_kl, adv, torch.ones(2, 1), 0.2)
    assert no_dual[0, 0].item() == pytest.approx(3.0)


def test_gspo_uses_one_sequence_ratio() -> None:
    # old - new over masked tokens: (0.2, -0.4) -> mean -0.1; the masked 9.0 is ignored
    lp = torch.zeros(1, 3)
    old = torch.tensor([[0.2, -0.4, 9.0]])
    kl = gspo_kl(lp, old, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(kl, torch.full((1, 3), -0.1))
    algo = AlgorithmConfig(advantage_estimator="gspo", eps_clip=0.5)
    inputs = LossInputs(
        log_probs=lp, loss_mask=torch.tensor([[1.0, 1.0, 0.0]]), entropy=torch.zeros(1, 3),
        old_log_probs=old, advantages=torch.ones(1, 3),
    )
    _, terms = actor_loss(algo, inputs, 1)
    # both tokens: -exp(0.1) * 1 = -1.10517 (within [0.5, 1.5]); per-sample mean -1.10517
    assert terms["pg_loss"].item() == pytest.approx(-math.exp(0.1), rel=1e-6)


def test_value_loss_clips_by_hand() -> None:
    # token 0: V 1.0, V_old 0.5, R 2 -> clip(V) = 0.7: max((0.7-2)^2, (1-2)^2) = 1.69, clipped
    # token 1: V 0.6, V_old 0.5, R 0 -> |dV| 0.1 < 0.2: 0.36 both ways, not clipped
    values = torch.tensor([[1.0, 0.6]])
    old = torch.tensor([[0.5, 0.5]])
    ret = torch.tensor([[2.0, 0.0]])
    loss, clip = value_loss(values, old, ret, torch.ones(1, 2), 0.2)
    torch.testing.assert_close(loss, torch.tensor([[1.69, 0.36]]))
    assert clip.tolist() == [[1.0, 0.0]]
    total, terms = critic_loss(AlgorithmConfig(), values, old, ret, torch.ones(1, 2), 1)
    assert total.item() == pytest.approx((1.69 + 0.36) / 2)
    assert terms["value_clipfrac"].item() == pytest.approx(0.5)


def test_lr_schedule_by_hand() -> None:
    # warmup 2: (step + 1) / 2 -> 0.5, 1.0; cosine over steps [2, 6) down to 0.1
    kw = {"warmup_steps": 2, "decay_style": "cosine", "decay_steps": 6, "min_lr": 0.1}
    assert [lr_at(s, 1.0, **kw) for s in (0, 1, 2)] == pytest.approx([0.5, 1.0, 1.0])  # type: ignore[arg-type]
    # step 4: progress 2/4 -> 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert lr_at(4, 1.0, **kw) == pytest.approx(0.55)  # type: ignore[arg-type]
    assert lr_at(9, 1.0, **kw) == pytest.approx(0.1)  # type: ignore[arg-type]
    # linear, step 3: progress 1/4 -> 1 - 0.9 / 4 = 0.775
    assert lr_at(3, 1.0, 2, "linear", 6, 0.1) == pytest.approx(0.775)
    assert lr_at(100, 1.0) == 1.0
