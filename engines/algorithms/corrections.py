"""Rollout corrections: the policy-gradient loss of tokens the engine sampled, corrected for
the engine sampling with other probabilities than the trainer.

Three policies meet in a step (AReaL's decoupled PPO): the behaviour policy that sampled
the tokens (the engine, `rollout_log_probs`), the proximal policy the PPO clip is measured
against (the trainer's old log-probs, `old_log_probs`) and the policy being trained. They
differ by bf16 kernels, MoE routing or stale weights. Per token

    r = pi_old / pi_rollout = exp(old_log_probs - rollout_log_probs)      (no gradient)

and each mode turns r into a weight on the token's PPO-clip loss:

    mode        weight                                        reference
    none        1
    token_tis   clamp(r, low, high)                           TIS (Yao et al.)
    token_mis   1 if low <= r <= high else 0                  masked IS
    seq_tis     clamp(g, low, high) on every token            g = exp(masked mean of log r)
    seq_mis     1 if low <= g <= high else 0, every token     geometric-mean rejection
    icepop      r if low <= r <= high else 0                  IcePop (Ring-1T)
    decoupled   r if r <= high else 0                         AReaL's behav_imp_weight_cap

A dropped token keeps its place in the loss's denominator (as in IcePop's 1 / |y|): it
lowers the step's gradient instead of reweighting the other tokens, and the reductions stay
exact over micro-batches. Weights are 0 outside the loss mask, so a garbage log-prob there
(a tool token, padding) reaches neither the loss nor its gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.config.algorithm import RolloutCorrectionConfig


@dataclass(frozen=True, slots=True)
class Correction:
    """One mode's result, `[batch, response_len]` each, 0 / False outside the loss mask."""

    weights: Tensor
    """Multiplies each token's policy-gradient loss; no gradient."""
    masked: Tensor
    """Tokens the mode drops (weight 0 because the ratio is out of bounds)."""
    truncated: Tensor
    """Tokens whose weight was clamped to a bound (TIS modes)."""


CorrectionFn = Callable[[Tensor, Tensor, float, float], Correction]
"""`(log_ratio, loss_mask, low, high) -> Correction`, `log_ratio` = old - rollout."""


def _in(x: Tensor, low: float, high: float) -> Tensor:
    return (x >= low) & (x <= high)


def _finish(weights: Tensor, masked: Tensor, truncated: Tensor, loss_mask: Tensor) -> Correction:
    keep = loss_mask.bool()
    zero = torch.zeros_like(weights)
    return Correction(torch.where(keep, weights, zero), masked & keep, truncated & keep)


def sequence_log_ratio(log_ratio: Tensor, loss_mask: Tensor) -> Tensor:
    """Each row's mean log-ratio over its loss-masked tokens (the log of the geometric mean
    of its token ratios), broadcast to the row's tokens; 0 for a row with none."""
    keep = loss_mask.bool()
    total = torch.where(keep, log_ratio, torch.zeros_like(log_ratio)).sum(-1, keepdim=True)
    return (total / keep.sum(-1, keepdim=True).clamp_min(1)).expand_as(log_ratio)


def no_correction(log_ratio: Tensor, loss_mask: Tensor, low: float, high: float) -> Correction:
    none = torch.zeros_like(log_ratio, dtype=torch.bool)
    return _finish(torch.ones_like(log_ratio), none, none, loss_mask)


def _truncate(ratio: Tensor, loss_mask: Tensor, low: float, high: float) -> Correction:
    weights = ratio.clamp(low, high)
    return _finish(weights, torch.zeros_like(ratio, dtype=torch.bool), weights != ratio, loss_mask)


def _mask(ratio: Tensor, loss_mask: Tensor, low: float, high: float) -> Correction:
    kept = _in(ratio, low, high)
    return _finish(kept.to(ratio.dtype), ~kept, torch.zeros_like(kept), loss_mask)


def token_tis(log_ratio: Tensor, loss_mask: Tensor, low: float, high: float) -> Correction:
    """Truncated importance sampling: every token keeps a weight, bounded to [low, high]."""
    return _truncate(log_ratio.exp(), loss_mask, low, high)


def token_mis(log_ratio: Tensor, loss_mask: Tensor, low: float, high: float) -> Correction:
    """Masked importance sampling: a token far off the trainer is dropped, the rest keep
    weight 1 (no reweighting, so no variance from the ratio itself)."""
    return _mask(log_ratio.exp(), loss_mask, low, high)


def seq_tis(log_ratio: Tensor, loss_mask: Tensor, low: float, high: float) -> Correction:
    """TIS on the geometric-mean ratio: one bounded weight per sequence, so a single odd
    token moves its sequence a little instead of its own weight a lot."""
    return _truncate(sequence_log_ratio(log_ratio, loss_mask).exp(), loss_mask, low, high)


def seq_mis(log_ratio: Tensor, loss_mask: Tensor, low: float, high: float) -> Correction:
    """Drop whole sequences whose geometric-mean ratio is out of bounds: a trajectory the
    engine sampled off the trainer's distribution teaches nothing reliable."""
    return _mask(sequence_log_ratio(log_ratio, loss_mask).exp(), loss_mask, low, high)


def icepop(log_ratio: Tensor, loss_mask: Tensor, low: float, high: float) -> Correction:
    """IcePop: calibrate in-bound tokens by their ratio, drop the others in both
    directions, so the tokens where training and inference disagree most (MoE routing
    flips) contribute no gradient."""
    ratio = log_ratio.exp()
    kept = _in(ratio, low, high)
    weights = torch.where(kept, ratio, torch.zeros_like(ratio))
    return _finish(weights, ~kept, torch.zeros_like(kept), loss_mask)


def decoupled(log_ratio: Tensor, loss_mask: Tensor, low: float, high: float) -> Correction:
    """AReaL's decoupled PPO: the clip is against the proximal policy (the trainer's old
    log-probs, as every mode here) and the loss is weighted by the behaviour importance
    weight pi_prox / pi_behav; tokens whose weight exceeds `high` are dropped, as AReaL's
    `behav_imp_weight_cap` does. `low` is not used."""
    ratio = log_ratio.exp()
    kept = ratio <= high
    weights = torch.where(kept, ratio, torch.zeros_like(ratio))
    return _finish(weights, ~kept, torch.zeros_like(kept), loss_mask)


CORRECTIONS: dict[str, CorrectionFn] = {
    "none": no_correction,
    "token_tis": token_tis,
    "token_mis": token_mis,
    "seq_tis": seq_tis,
    "seq_mis": seq_mis,
    "icepop": icepop,
    "decoupled": decoupled,
}


def rollout_log_ratio(old_log_probs: Tensor, rollout_log_probs: Tensor) -> Tensor:
    """log r = old - rollout in float32, detached: the corrections carry no gradient."""
    return old_log_probs.detach().float() - rollout_log_probs.detach().float()


def rollout_correction(
    cfg: RolloutCorrectionConfig, old_log_probs: Tensor, rollout_log_probs: Tensor,
    loss_mask: Tensor,
) -> Correction:
    """The configured mode's weights for one batch, `[batch, response_len]` each."""
    low, high = cfg.bounds
    return CORRECTIONS[cfg.mode](
        rollout_log_ratio(old_log_probs, rollout_log_probs), loss_mask, low, high
    )


def mismatch_metrics(
    cfg: RolloutCorrectionConfig, old_log_probs: Tensor, rollout_log_probs: Tensor,
    loss_mask: Tensor,
) -> dict[str, float]:
    """Token means over the loss-masked tokens of a whole batch (empty if it has none):

    * `ratio_mean`, `ratio_min`, `ratio_max`: r = pi_old / pi_rollout per token;
    * `masked_frac`, `truncated_frac`: tokens the mode drops / clamps;
    * `k3_kl`: KL(rollout || trainer), estimated from tokens the engine sampled. With
      r = pi_old / pi_rollout, E_rollout[r] = 1 and E_rollout[-log r] = KL(rollout ||
      trainer), so k3 = r - 1 - log r is unbiased for it and never negative (Schulman's
      k3, with the sampling policy in the denominator of r).
    """
    keep = loss_mask.bool()
    if not bool(keep.any()):
        return {}
    log_ratio = rollout_log_ratio(old_log_probs, rollout_log_probs)
    correction = rollout_correction(cfg, old_log_probs, rollout_log_probs, loss_mask)
    lr = log_ratio[keep]
    ratio = lr.exp()
    n = float(keep.sum())
    return {
        "ratio_mean": float(ratio.mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "masked_frac": float(correction.masked.sum()) / n,
        "truncated_frac": float(correction.truncated.sum()) / n,
        "k3_kl": float((ratio - 1.0 - lr).mean()),
    }
