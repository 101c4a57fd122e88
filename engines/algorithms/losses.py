"""Policy-gradient, KL and SFT losses as pure tensor functions.

All per-token tensors are `[batch, response_len]` and aligned with the response (slot `t` is
response token `t`), with a 0/1 `loss_mask` of the same shape. Per-token functions return
per-token values that are exactly 0 where the mask is 0 (built with `torch.where`, so
padding contributes nothing to the value *or* the gradient even if it holds garbage); the
reductions then turn them into scalars.

Formulas follow slime (`slime/utils/ppo_utils.py`, `slime/backends/*/loss.py`) so that
curves are comparable:

* ratio = exp(log_p - log_p_old); ppo_kl = log_p_old - log_p (reported as `approx_kl`)
* pg = max(-ratio * A, -clip(ratio, 1 - eps_clip, 1 + eps_clip_high) * A); clipfrac marks
  the tokens where the clipped branch wins.
* KL to the reference: k1 = log r, k2 = (log r)^2 / 2, k3 = low_var_kl = exp(-log r) - 1 +
  log r with log r = log_p - log_p_ref; low_var_kl is clamped to [-10, 10].
* pg is weighted per token by `algorithm.rollout_correction` (`corrections.py`) when the
  engine's log-probs are there.
* loss = pg - entropy_coef * entropy + kl_loss_coef * kl   (kl only when use_kl_loss).

Reductions take an explicit denominator (`num_samples` / `num_tokens`) so that a global batch
split into micro-batches sums to exactly the loss of the unsplit batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.algorithms.corrections import rollout_correction
from engines.config.algorithm import AlgorithmConfig


def _masked(x: Tensor, loss_mask: Tensor) -> Tensor:
    return torch.where(loss_mask.bool(), x, torch.zeros_like(x))


def masked_mean_per_sample(x: Tensor, loss_mask: Tensor, num_samples: int | None = None) -> Tensor:
    """slime's default reduction: each sample's mean over its masked tokens, then the mean
    over samples, so long and short responses weigh the same.

    A sample with no masked token contributes 0 but still counts in the denominator.
    `num_samples` (default: this batch's size) lets a micro-batch be scaled as part of a larger
    global batch.
    """
    per_sample = _masked(x, loss_mask).sum(dim=-1) / loss_mask.sum(dim=-1).clamp_min(1)
    denom = x.shape[0] if num_samples is None else num_samples
    return per_sample.sum() / max(denom, 1)


def masked_mean_per_token(x: Tensor, loss_mask: Tensor, num_tokens: float | None = None) -> Tensor:
    """Global token mean (`calculate_per_token_loss`): every masked token weighs the same.

    `num_tokens` (default: this batch's masked-token count) plays the role of `num_samples`
    in `masked_mean_per_sample`.
    """
    denom = float(loss_mask.sum().item()) if num_tokens is None else num_tokens
    return _masked(x, loss_mask).sum() / max(denom, 1.0)


def policy_loss_from_kl(
    ppo_kl: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO-clip surrogate per token from `ppo_kl = old - new`: `(loss, clipfrac)`.

    Dual clip (`eps_clip_c` > 1): where A < 0 the loss is further capped at
    `-eps_clip_c * A`, so a huge ratio on a bad token cannot blow the loss up.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(-ppo_kl)
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + high) * advantages
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c must be > 1, got {eps_clip_c}")
        capped = torch.minimum(loss, -eps_clip_c * advantages)
        loss = torch.where(advantages < 0, capped, loss)
    return _masked(loss, loss_mask), _masked(clipfrac, loss_mask)


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Token-level PPO-clip: `(loss, clipfrac, approx_kl)`, zero where masked.

    `eps_clip_high` (clip-higher, DAPO) defaults to `eps_clip`. `advantages` broadcasts
    (e.g. `[batch, 1]` for GRPO's per-sample advantage).
    """
    ppo_kl = old_log_probs - log_probs
    loss, clipfrac = policy_loss_from_kl(
        ppo_kl, advantages, loss_mask, eps_clip, eps_clip_high, eps_clip_c
    )
    return loss, clipfrac, _masked(ppo_kl, loss_mask)


def gspo_kl(log_probs: Tensor, old_log_probs: Tensor, loss_mask: Tensor) -> Tensor:
    """GSPO's sequence-level `ppo_kl`: each sample's masked mean of (old - new), broadcast to
    its tokens, so every token of a sample shares one ratio (the geometric mean)."""
    diff = _masked(old_log_probs - log_probs, loss_mask).sum(dim=-1, keepdim=True)
    seq = diff / loss_mask.sum(dim=-1, keepdim=True).clamp_min(1)
    return seq.expand_as(log_probs)


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, loss_mask: Tensor, value_clip: float
) -> tuple[Tensor, Tensor]:
    """Clipped value loss per token (slime): max((clip(V) - R)^2, (V - R)^2) with
    clip(V) = V_old + clamp(V - V_old, -value_clip, value_clip); `(loss, clipfrac)`."""
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    loss = torch.maximum((clipped - returns) ** 2, (values - returns) ** 2)
    clipfrac = ((values - old_values).abs() > value_clip).float()
    return _masked(loss, loss_mask), _masked(clipfrac, loss_mask)


def _k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


def _k2(log_ratio: Tensor) -> Tensor:
    return log_ratio.pow(2) / 2.0


def _k3(log_ratio: Tensor) -> Tensor:
    # Schulman's non-negative, unbiased estimator of KL(pi || ref) from samples of pi.
    return torch.exp(-log_ratio) - 1.0 + log_ratio


def _low_var_kl(log_ratio: Tensor) -> Tensor:
    # k3 clamped for numerical safety when the policy drifts far from the reference.
    return _k3(log_ratio).clamp(-10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "low_var_kl": _low_var_kl,
}


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs."""
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; one of {sorted(KL_ESTIMATORS)}") from None
    return estimator(log_probs.float() - ref_log_probs.float())


def sft_loss(log_probs: Tensor, loss_mask: Tensor) -> Tensor:
    """Per-token negative log-likelihood, zero where masked (reduce it like the RL loss)."""
    return _masked(-log_probs, loss_mask)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum(p * z)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


@dataclass(frozen=True, slots=True)
class LossInputs:
    """Per-token tensors of one micro-batch, all `[batch, response_len]` (advantages may be
    `[batch, 1]`); optional ones are None when the algorithm does not need them."""

    log_probs: Tensor
    loss_mask: Tensor
    entropy: Tensor
    old_log_probs: Tensor | None = None
    advantages: Tensor | None = None
    ref_log_probs: Tensor | None = None
    rollout_log_probs: Tensor | None = None
    """Engine log-probs: the mismatch metrics, and the behaviour policy of
    `algorithm.rollout_correction`."""


Reducer = Callable[[Tensor], Tensor]


def make_reducer(per_token: bool, loss_mask: Tensor, denominator: float) -> Reducer:
    """The step's reduction (see module docstring) bound to one micro-batch's mask."""
    if per_token:
        return lambda x: masked_mean_per_token(x, loss_mask, denominator)
    return lambda x: masked_mean_per_sample(x, loss_mask, int(denominator))


def _pg_terms(algo: AlgorithmConfig, inputs: LossInputs, reduce: Reducer) -> dict[str, Tensor]:
    if inputs.old_log_probs is None or inputs.advantages is None:
        raise ValueError("policy_loss needs old_log_probs and advantages")
    mask = inputs.loss_mask
    if algo.advantage_estimator == "gspo":
        ppo_kl = gspo_kl(inputs.log_probs, inputs.old_log_probs, mask)
    else:
        ppo_kl = inputs.old_log_probs - inputs.log_probs
    pg_tok, clip_tok = policy_loss_from_kl(
        ppo_kl, inputs.advantages, mask, algo.eps_clip, algo.eps_clip_high, algo.eps_clip_c
    )
    terms: dict[str, Tensor] = {}
    if inputs.rollout_log_probs is not None:
        if algo.rollout_correction.enabled:
            correction = rollout_correction(
                algo.rollout_correction, inputs.old_log_probs, inputs.rollout_log_probs, mask
            )
            pg_tok = pg_tok * correction.weights
        terms["ois"] = reduce(torch.exp(-ppo_kl.detach()))
        terms["train_rollout_logprob_abs_diff"] = reduce(
            (inputs.old_log_probs - inputs.rollout_log_probs).abs()
        )
    elif algo.rollout_correction.enabled:
        raise ValueError("algorithm.rollout_correction needs rollout_log_probs on every sample")
    terms.update(
        pg_loss=reduce(pg_tok), clipfrac=reduce(clip_tok), approx_kl=reduce(_masked(ppo_kl, mask))
    )
    return terms


def zero_gradient_samples(
    algo: AlgorithmConfig, advantages: list[Tensor], loss_masks: list[Tensor]
) -> set[int]:
    """Samples whose actor-loss term and gradient are exactly 0, so training may leave them
    out: no loss-masked token (every built-in loss masks), or, under the PPO-clip surrogate
    alone (no entropy bonus, no KL loss), an advantage of 0 on every masked token, as in a
    GRPO group whose responses all got the same reward (both clip branches are -ratio * 0).
    A custom loss keeps every sample."""
    if algo.loss_type == "custom_loss":
        return set()
    surrogate_only = (
        algo.loss_type == "policy_loss" and algo.entropy_coef == 0.0 and not algo.use_kl_loss
    )
    zero = set()
    for i, (adv, mask) in enumerate(zip(advantages, loss_masks, strict=True)):
        masked = mask.bool()
        if not bool(masked.any()) or (surrogate_only and not bool(adv[masked].any())):
            zero.add(i)
    return zero


def actor_loss(
    algo: AlgorithmConfig, inputs: LossInputs, denominator: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """The trained scalar for one micro-batch plus detached metric terms.

    `denominator` is the number of samples (per-sample reduction) or masked tokens
    (per-token reduction) of the whole optimizer step, so summing micro-batch results gives
    the step's value.
    """
    reduce = make_reducer(algo.calculate_per_token_loss, inputs.loss_mask, denominator)
    entropy = reduce(inputs.entropy)
    zero = torch.zeros((), dtype=torch.float32, device=inputs.log_probs.device)
    if algo.loss_type == "sft_loss":
        terms = {"pg_loss": reduce(sft_loss(inputs.log_probs, inputs.loss_mask))}
        terms.update(clipfrac=zero, approx_kl=zero)
    else:
        terms = _pg_terms(algo, inputs, reduce)
    loss = terms["pg_loss"] - algo.entropy_coef * entropy
    kl = zero
    if algo.use_kl_loss:
        if inputs.ref_log_probs is None:
            raise ValueError("use_kl_loss needs ref_log_probs")
        kl = reduce(kl_penalty(inputs.log_probs, inputs.ref_log_probs, algo.kl_loss_type))
        loss = loss + algo.kl_loss_coef * kl
    terms.update(loss=loss, kl_loss=kl, entropy=entropy)
    return loss, {k: v.detach() for k, v in terms.items()}


def critic_loss(
    algo: AlgorithmConfig,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    loss_mask: Tensor,
    denominator: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss of one micro-batch, reduced like the actor loss."""
    reduce = make_reducer(algo.calculate_per_token_loss, loss_mask, denominator)
    loss_tok, clip_tok = value_loss(values, old_values, returns, loss_mask, algo.value_clip)
    loss = reduce(loss_tok)
    return loss, {"value_loss": loss.detach(), "value_clipfrac": reduce(clip_tok).detach()}
