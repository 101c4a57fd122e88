"""Advantage estimators by name (`algorithm.advantage_estimator`), plus the pipeline around
them: custom hook, on-policy distillation, whitening.

Every estimator is a pure function `(algo_cfg, AdvantageInputs) -> (advantages, returns)`
with one 1-D tensor per sample and response token. Order of operations follows slime's
`compute_advantages_and_returns`:

    kl (old vs ref, only when kl_coef != 0)
      -> estimator (or the custom hook)          -> advantages, returns
      -> on-policy distillation: A -= opd_kl_coef * (log p_student - log p_teacher)
      -> optional masked whitening of A over the whole rollout batch

Returns are only used by the critic (ppo); the others report advantages as returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.algorithms.advantages import (
    gae,
    group_mean_baseline,
    grpo_advantages_by_group,
    masked_whiten,
    ppo_token_rewards,
    reinforce_plus_plus_returns,
    rloo_advantages_by_group,
)
from engines.config.algorithm import AlgorithmConfig
from engines.hooks.loader import HookError, checked_returns, load_user_hook

Estimates = tuple[list[Tensor], list[Tensor]]


@dataclass(frozen=True, slots=True)
class AdvantageInputs:
    """Per-sample inputs of one rollout batch; per-token entries are 1-D `[response_len]`."""

    rewards: Tensor
    group_indices: list[int]
    loss_masks: list[Tensor]
    kl: list[Tensor]
    values: list[Tensor] | None = None
    log_probs: list[Tensor] | None = None
    teacher_log_probs: list[Tensor] | None = None


@dataclass(frozen=True, slots=True)
class AdvantageResult:
    advantages: list[Tensor]
    returns: list[Tensor]
    opd_reverse_kl: list[Tensor] | None = None


Estimator = Callable[[AlgorithmConfig, AdvantageInputs], Estimates]


def _broadcast(scalars: Tensor, like: list[Tensor]) -> list[Tensor]:
    return [
        torch.full((m.numel(),), float(s), dtype=torch.float32)
        for s, m in zip(scalars, like, strict=True)
    ]


def _grpo(algo: AlgorithmConfig, x: AdvantageInputs) -> Estimates:
    scalars = grpo_advantages_by_group(
        x.rewards.tolist(), x.group_indices, algo.grpo_std_normalization
    )
    adv = _broadcast(scalars, x.loss_masks)
    return adv, adv


def _rloo(algo: AlgorithmConfig, x: AdvantageInputs) -> Estimates:
    adv = _broadcast(rloo_advantages_by_group(x.rewards, x.group_indices), x.loss_masks)
    return adv, adv


def _reinforce_pp(algo: AlgorithmConfig, x: AdvantageInputs) -> Estimates:
    # A fully masked response is one rollout.sample_filter_path removed: it trains on nothing.
    ret = [
        reinforce_plus_plus_returns(float(r), kl, m, algo.kl_coef, algo.gamma)
        if m.any() else torch.zeros_like(kl, dtype=torch.float32)
        for r, kl, m in zip(x.rewards, x.kl, x.loss_masks, strict=True)
    ]
    return ret, ret


def _reinforce_pp_baseline(algo: AlgorithmConfig, x: AdvantageInputs) -> Estimates:
    baseline = group_mean_baseline(x.rewards, x.group_indices)
    adv = [float(b) - algo.kl_coef * kl.float() for b, kl in zip(baseline, x.kl, strict=True)]
    return adv, adv


def _ppo(algo: AlgorithmConfig, x: AdvantageInputs) -> Estimates:
    if x.values is None:
        raise ValueError("advantage_estimator 'ppo' needs critic values")
    advs, rets = [], []
    for r, kl, v in zip(x.rewards, x.kl, x.values, strict=True):
        a, ret = gae(ppo_token_rewards(float(r), kl, algo.kl_coef), v, algo.gamma, algo.lambd)
        advs.append(a)
        rets.append(ret)
    return advs, rets


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {
    "grpo": _grpo,
    "gspo": _grpo,  # same advantages; GSPO differs in the ratio (losses.gspo_kl)
    "rloo": _rloo,
    "reinforce_plus_plus": _reinforce_pp,
    "reinforce_plus_plus_baseline": _reinforce_pp_baseline,
    "ppo": _ppo,
}


def load_estimator(algo: AlgorithmConfig) -> Estimator:
    """The custom hook if configured (checked now, not at the first step), else the built-in."""
    if algo.custom_advantage_function_path:
        key = "algorithm.custom_advantage_function_path"
        return checked_returns(
            load_user_hook(algo.custom_advantage_function_path, key, 2), key,
            lambda r: isinstance(r, tuple | list) and len(r) == 2,
            "a pair (advantages, returns) of per-sample lists",
        )
    try:
        return ADVANTAGE_ESTIMATORS[algo.advantage_estimator]
    except KeyError:
        raise ValueError(
            f"algorithm.advantage_estimator: unknown {algo.advantage_estimator!r}; "
            f"one of {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None


def compute_advantages(
    algo: AlgorithmConfig, x: AdvantageInputs, estimator: Estimator | None = None
) -> AdvantageResult:
    """Run the estimator, then distillation and whitening (see the module docstring)."""
    advantages, returns = (estimator or load_estimator(algo))(algo, x)
    if len(advantages) != len(x.loss_masks):  # a HookError: the same on every retry
        which = algo.custom_advantage_function_path or algo.advantage_estimator
        raise HookError(
            f"advantage estimator {which} returned {len(advantages)} rows for "
            f"{len(x.loss_masks)} samples"
        )
    reverse_kl = None
    if algo.use_opd:
        if x.teacher_log_probs is None or x.log_probs is None:
            raise ValueError("use_opd needs student (old) and teacher log-probs")
        reverse_kl = [
            s.float() - t.float() for s, t in zip(x.log_probs, x.teacher_log_probs, strict=True)
        ]
        advantages = [a - algo.opd_kl_coef * k for a, k in zip(advantages, reverse_kl, strict=True)]
    if algo.normalize_advantages:
        advantages = masked_whiten(advantages, x.loss_masks)
    return AdvantageResult(advantages, returns, reverse_kl)
