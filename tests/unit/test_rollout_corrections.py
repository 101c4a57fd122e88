"""algorithm.rollout_correction against numbers worked out by hand on one small batch.

Two sequences of three tokens; the trainer's old log-probs are 0 and the engine's are
-log r, so each token's ratio r = exp(old - rollout) is the number written below:

    A: r = (1.25, 0.4, 16)   loss mask (1, 1, 1)   geometric mean (1.25 * 0.4 * 16)^(1/3) = 2
    B: r = (1.2, 0.3, 100)   loss mask (1, 1, 0)   geometric mean (1.2 * 0.3)^(1/2) = 0.6

Bounds [low, high] = [0.5, 1.5] (decoupled: high 1.5, no low). The 100 of B is outside the
loss mask: no mode may let it through.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from pydantic import ValidationError

from engines.algorithms.corrections import CORRECTIONS, mismatch_metrics, rollout_correction
from engines.algorithms.losses import LossInputs, actor_loss
from engines.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig

RATIOS = [[1.25, 0.4, 16.0], [1.2, 0.3, 100.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
OLD = torch.zeros(2, 3)
ROLLOUT = -torch.tensor(RATIOS).log()


def _cfg(mode: str) -> RolloutCorrectionConfig:
    if mode == "none":
        return RolloutCorrectionConfig()
    if mode == "decoupled":
        return RolloutCorrectionConfig(mode="decoupled", high=1.5)
    return RolloutCorrectionConfig(mode=mode, low=0.5, high=1.5)  # type: ignore[arg-type]


# mode: (weights, masked, truncated), each written out from the ratios above
BY_HAND = {
    "none": ([[1, 1, 1], [1, 1, 0]], [[0, 0, 0], [0, 0, 0]], [[0, 0, 0], [0, 0, 0]]),
    # clamp to [0.5, 1.5]: 0.4 -> 0.5, 16 -> 1.5, 0.3 -> 0.5
    "token_tis": ([[1.25, 0.5, 1.5], [1.2, 0.5, 0]], [[0, 0, 0], [0, 0, 0]],
                  [[0, 1, 1], [0, 1, 0]]),
    # 1.25 and 1.2 inside [0.5, 1.5] keep weight 1; 0.4, 16 and 0.3 are dropped
    "token_mis": ([[1, 0, 0], [1, 0, 0]], [[0, 1, 1], [0, 1, 0]], [[0, 0, 0], [0, 0, 0]]),
    # geometric means 2 -> clamped to 1.5 on all of A; 0.6 inside, on B's two loss tokens
    "seq_tis": ([[1.5, 1.5, 1.5], [0.6, 0.6, 0]], [[0, 0, 0], [0, 0, 0]],
                [[1, 1, 1], [0, 0, 0]]),
    # A's mean 2 is above 1.5: all of A dropped; B's 0.6 is inside: weight 1
    "seq_mis": ([[0, 0, 0], [1, 1, 0]], [[1, 1, 1], [0, 0, 0]], [[0, 0, 0], [0, 0, 0]]),
    # in-bound tokens keep their ratio, the others are dropped
    "icepop": ([[1.25, 0, 0], [1.2, 0, 0]], [[0, 1, 1], [0, 1, 0]], [[0, 0, 0], [0, 0, 0]]),
    # only ratios above 1.5 are dropped (16); the others keep their ratio, 0.4 and 0.3 too
    "decoupled": ([[1.25, 0.4, 0], [1.2, 0.3, 0]], [[0, 0, 1], [0, 0, 0]],
                  [[0, 0, 0], [0, 0, 0]]),
}

# pg loss on-policy (ratio 1, inside the clip) with advantage 1: -weight per token; slime's
# per-sample mean (A over 3 tokens, B over 2), then the mean of the two samples
PG_LOSS_BY_HAND = {
    "none": (-3 / 3 - 2 / 2) / 2,                              # -1
    "token_tis": (-(1.25 + 0.5 + 1.5) / 3 - (1.2 + 0.5) / 2) / 2,  # -0.9666...
    "token_mis": (-1 / 3 - 1 / 2) / 2,                         # -0.41666...
    "seq_tis": (-(3 * 1.5) / 3 - (2 * 0.6) / 2) / 2,           # -1.05
    "seq_mis": (-0 / 3 - 2 / 2) / 2,                           # -0.5
    "icepop": (-1.25 / 3 - 1.2 / 2) / 2,                       # -0.50833...
    "decoupled": (-(1.25 + 0.4) / 3 - (1.2 + 0.3) / 2) / 2,    # -0.65
}


def test_every_mode_is_registered_and_checked_here() -> None:
    assert set(CORRECTIONS) == set(BY_HAND) == set(PG_LOSS_BY_HAND)


@pytest.mark.parametrize("mode", sorted(BY_HAND))
def test_weights_masks_and_truncation_by_hand(mode: str) -> None:
    weights, masked, truncated = BY_HAND[mode]
    got = rollout_correction(_cfg(mode), OLD, ROLLOUT, MASK)
    torch.testing.assert_close(got.weights, torch.tensor(weights, dtype=torch.float32))
    assert got.masked.int().tolist() == masked
    assert got.truncated.int().tolist() == truncated
    assert not got.weights.requires_grad


@pytest.mark.parametrize("mode", sorted(PG_LOSS_BY_HAND))
def test_pg_loss_by_hand(mode: str) -> None:
    inputs = LossInputs(
        log_probs=OLD.clone().requires_grad_(), loss_mask=MASK, entropy=torch.zeros(2, 3),
        old_log_probs=OLD, advantages=torch.ones(2, 1), rollout_log_probs=ROLLOUT,
    )
    _, terms = actor_loss(AlgorithmConfig(rollout_correction=_cfg(mode)), inputs, 2)
    assert terms["pg_loss"].item() == pytest.approx(PG_LOSS_BY_HAND[mode], rel=1e-6)
    if mode != "none":  # a mode that were ignored would give the uncorrected -1
        assert terms["pg_loss"].item() != pytest.approx(-1.0)


def test_mode_none_is_the_loss_without_engine_log_probs() -> None:
    """Off-policy (ratios away from 1, some clipped), with a mask: with mode none the engine's
    log-probs only add metrics; the loss and its gradient are bit-identical."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(2, 3, generator=gen) * 2
    new = old + torch.randn(2, 3, generator=gen) * 0.5
    adv = torch.tensor([[1.0], [-0.5]])

    def loss_and_grad(rollout: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        log_probs = new.clone().requires_grad_()
        inputs = LossInputs(log_probs=log_probs, loss_mask=MASK, entropy=torch.zeros(2, 3),
                            old_log_probs=old, advantages=adv, rollout_log_probs=rollout)
        loss, _ = actor_loss(AlgorithmConfig(), inputs, 2)
        loss.backward()
        assert log_probs.grad is not None
        return loss.detach(), log_probs.grad

    with_rollout, without = loss_and_grad(ROLLOUT), loss_and_grad(None)
    assert torch.equal(with_rollout[0], without[0]) and torch.equal(with_rollout[1], without[1])
    # and a mode that corrects does change it on the same inputs
    inputs = LossInputs(log_probs=new, loss_mask=MASK, entropy=torch.zeros(2, 3),
                        old_log_probs=old, advantages=adv, rollout_log_probs=ROLLOUT)
    icepop = actor_loss(AlgorithmConfig(rollout_correction=_cfg("icepop")), inputs, 2)[0]
    assert not torch.equal(icepop, without[0])


def test_a_correction_without_engine_log_probs_fails() -> None:
    inputs = LossInputs(log_probs=OLD, loss_mask=MASK, entropy=torch.zeros(2, 3),
                        old_log_probs=OLD, advantages=torch.ones(2, 1))
    with pytest.raises(ValueError, match="algorithm.rollout_correction needs rollout_log_probs"):
        actor_loss(AlgorithmConfig(rollout_correction=_cfg("token_mis")), inputs, 2)


def test_mismatch_metrics_by_hand() -> None:
    # the five loss tokens: 1.25, 0.4, 16, 1.2, 0.3 (B's 100 is outside the loss mask)
    m = mismatch_metrics(_cfg("token_mis"), OLD, ROLLOUT, MASK)
    assert m["ratio_mean"] == pytest.approx((1.25 + 0.4 + 16 + 1.2 + 0.3) / 5)  # 3.83
    assert m["ratio_min"] == pytest.approx(0.3)
    assert m["ratio_max"] == pytest.approx(16.0)
    assert m["masked_frac"] == pytest.approx(3 / 5)  # 0.4, 16, 0.3
    assert m["truncated_frac"] == 0.0
    # k3 = r - 1 - ln r per token, then the mean:
    #   1.25: 0.25 - 0.22314 = 0.02686     0.4: -0.6 + 0.91629 = 0.31629
    #   16:  15 - 2.77259 = 12.22741       1.2: 0.2 - 0.18232 = 0.01768
    #   0.3: -0.7 + 1.20397 = 0.50397      sum 13.09221 / 5 = 2.61844
    assert m["k3_kl"] == pytest.approx(2.61844, abs=1e-4)
    assert m["k3_kl"] == pytest.approx(
        (0.25 - math.log(1.25) - 0.6 - math.log(0.4) + 15 - math.log(16) + 0.2 - math.log(1.2)
         - 0.7 - math.log(0.3)) / 5
    )
    tis = mismatch_metrics(_cfg("token_tis"), OLD, ROLLOUT, MASK)
    assert tis["truncated_frac"] == pytest.approx(3 / 5) and tis["masked_frac"] == 0.0
    assert mismatch_metrics(_cfg("decoupled"), OLD, ROLLOUT, MASK)["masked_frac"] == 0.2
    # the engine agreeing with the trainer: ratio 1, nothing dropped, KL 0
    same = mismatch_metrics(_cfg("icepop"), OLD, OLD, MASK)
    assert (same["ratio_min"], same["ratio_max"], same["masked_frac"], same["k3_kl"]) == (
        1.0, 1.0, 0.0, 0.0)


# -- the config ---------------------------------------------------------------------------
def test_unset_bounds_take_the_mode_defaults() -> None:
    def bounds(**kw: object) -> tuple[float, float]:
        return RolloutCorrectionConfig.model_validate(kw).bounds

    assert bounds(mode="token_tis") == (0.0, 2.0)
    assert bounds(mode="icepop") == (0.5, 5.0)
    assert bounds(mode="token_mis", high=3.0) == (0.5, 3.0)


@pytest.mark.parametrize("algorithm, loc, message", [
    ({"rollout_correction": {"mode": "seq_geo"}}, ("rollout_correction", "mode"),
     r"Input should be 'none', 'token_tis'"),
    ({"rollout_correction": {"mode": "token_mis", "low": -1}}, ("rollout_correction", "low"),
     r"Input should be greater than or equal to 0"),
    ({"rollout_correction": {"mode": "token_tis", "low": 1.2}}, ("rollout_correction",),
     r"algorithm.rollout_correction.low \(1.2\) and algorithm.rollout_correction.high "
     r"\(2.0\) must satisfy low <= 1 <= high"),
    ({"rollout_correction": {"mode": "icepop", "high": 0.9}}, ("rollout_correction",),
     r"algorithm.rollout_correction.high \(0.9\) must satisfy"),
    ({"rollout_correction": {"mode": "decoupled", "low": 0.5}}, ("rollout_correction",),
     r"algorithm.rollout_correction.low: decoupled has no lower bound"),
    ({"rollout_correction": {"high": 3.0}}, ("rollout_correction",),
     r"algorithm.rollout_correction.high are set but algorithm.rollout_correction.mode is "
     r"none"),
    ({"rollout_correction": {"mode": "token_tis"}, "use_rollout_logprobs": True}, (),
     r"algorithm.rollout_correction.mode='token_tis'.*algorithm.use_rollout_logprobs"),
    ({"rollout_correction": {"mode": "token_tis", "clip": 2.0}},
     ("rollout_correction", "clip"), r"Extra inputs are not permitted"),
    ({"use_tis": True}, ("use_tis",), r"Extra inputs are not permitted"),
])
def test_bad_settings_name_the_field(algorithm: dict, loc: tuple, message: str) -> None:
    """The error's location (what the config loader prints as `algorithm.<loc>`) or, for a
    check across fields, its message names the fields at fault."""
    with pytest.raises(ValidationError) as raised:
        AlgorithmConfig.model_validate(algorithm)
    [error] = raised.value.errors()
    assert error["loc"] == loc
    assert re.search(message, error["msg"]), error["msg"]
