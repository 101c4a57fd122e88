"""Everything a `train()` call needs before its first update, from the pre-update models.

    rewards ----------------------------------------------+
    old log-probs (policy)   ref log-probs (reference)    |
    teacher log-probs (opd)  values (critic)              v
            kl = estimator(old, ref) if kl_coef  --> advantage registry --> advantages, returns

Old log-probs are lazy when nothing before the first optimizer step needs them (no
reward-shaping KL, no distillation, no custom estimator) and the backend allows it (one data
parallel rank, one pipeline stage): the first step's samples then get theirs from that step's
own forward, which runs before any update (see `step._old_rows`), saving one forward over a
global batch. Otherwise the first step is scored on its own, then the rest: a backend that
shards a scored batch like a training step (megatron) then scores the first step in exactly
the micro-batches that train on it, so its on-policy ratio is exactly 1 even in bf16.

Zero-gradient samples (`losses.zero_gradient_samples`: e.g. a GRPO group whose responses all
got the same reward) are left out of the optimizer steps' rows when `skip_zero_gradient` is
set and nothing needed their old log-probs before the advantages (the lazy case's
condition), so they cost neither the old-log-prob forward nor the training passes. The
steps' loss denominators still count them, so each step's gradient is the full step's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engines.algorithms.losses import kl_penalty, zero_gradient_samples
from engines.algorithms.registry import AdvantageInputs, Estimator, compute_advantages
from engines.config.algorithm import AlgorithmConfig
from storage.sample import Sample

Scorer = Callable[[list[Sample]], list[Tensor]]


@dataclass(slots=True)
class PreparedBatch:
    """Per-sample inputs of one `train()` call; per-token entries are 1-D tensors.

    Mutable on purpose: lazy `old_log_probs` entries start as None and are filled by the
    first optimizer step's forward; a skipped sample's stays None. `steps`: the rows each
    optimizer step trains the actor on (every epoch's, in order).
    """

    rewards: Tensor
    advantages: list[Tensor]
    returns: list[Tensor]
    old_log_probs: list[Tensor | None] | None
    ref_log_probs: list[Tensor] | None
    rollout_log_probs: list[Tensor] | None
    values: list[Tensor] | None
    opd_reverse_kl: list[Tensor] | None
    response_lengths: list[int]
    steps: list[list[int]]

    @property
    def zero_gradient(self) -> int:
        """Samples in none of `steps`: left out of every actor pass."""
        return len(self.response_lengths) - len({i for idx in self.steps for i in idx})


@dataclass(frozen=True, slots=True)
class Scorers:
    policy: Scorer
    ref: Scorer | None = None
    teacher: Scorer | None = None
    critic: Scorer | None = None


def rollout_log_probs_of(samples: list[Sample], required: bool) -> list[Tensor] | None:
    """Engine log-probs when every sample carries a full set; an error if `required`."""
    for s in samples:
        if len(s.rollout_log_probs) != s.response_length:
            if required:
                raise ValueError(
                    f"sample {s.index}: needs {s.response_length} rollout_log_probs "
                    "(algorithm.use_rollout_logprobs / algorithm.rollout_correction), has "
                    f"{len(s.rollout_log_probs)}"
                )
            return None
    return [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]


def _rewards(samples: list[Sample], reward_key: str | None, is_rl: bool) -> Tensor:
    if is_rl or all(s.reward is not None for s in samples):
        return torch.tensor([s.scalar_reward(reward_key) for s in samples], dtype=torch.float32)
    return torch.zeros(len(samples))


def steps_without(steps: list[list[int]], skipped: set[int]) -> list[list[int]]:
    """Each optimizer step's rows less `skipped`. A step left with none keeps its first row
    (its gradient is zero), so the optimizer still steps as it would on the whole step:
    AdamW moves the weights on its momentum even with a zero gradient."""
    return [[i for i in idx if i not in skipped] or idx[:1] for idx in steps]


def prepare_batch(
    samples: list[Sample],
    algo: AlgorithmConfig,
    scorers: Scorers,
    estimator: Estimator,
    steps: list[list[int]],
    reward_key: str | None = None,
    lazy: bool = True,
    skip_zero_gradient: bool = False,
) -> PreparedBatch:
    """`steps`: every epoch's optimizer steps, as row lists; `lazy`: whether the backend may
    leave the first step's old log-probs to that step's forward; `skip_zero_gradient`:
    whether steps may leave out zero-gradient samples (see the module docstring)."""
    lengths = [s.response_length for s in samples]
    masks = [torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples]
    is_rl = algo.loss_type != "sft_loss"
    rewards = _rewards(samples, reward_key, is_rl)
    rollout = rollout_log_probs_of(
        samples, algo.use_rollout_logprobs or algo.rollout_correction.enabled
    )
    ref = scorers.ref(samples) if scorers.ref is not None else None
    if not is_rl:
        zeros = [torch.zeros(r) for r in lengths]
        return PreparedBatch(rewards, zeros, zeros, None, ref, rollout, None, None, lengths,
                             steps)
    eager = algo.kl_coef != 0 or algo.use_opd or algo.custom_advantage_function_path is not None
    old: list[Tensor | None] = [None] * len(samples)
    if algo.use_rollout_logprobs:
        assert rollout is not None
        old = list(rollout)
    elif eager:  # the advantages need them all, before anything is skipped
        _score_old(old, samples, scorers, steps[0], lazy=False)
    full_old = [t for t in old if t is not None] if eager or algo.use_rollout_logprobs else None
    if algo.kl_coef != 0:
        if ref is None or full_old is None:
            raise ValueError("algorithm.kl_coef needs the reference model")
        kl = [kl_penalty(o, r, algo.kl_loss_type) for o, r in zip(full_old, ref, strict=True)]
    else:
        kl = [torch.zeros(r) for r in lengths]
    inputs = AdvantageInputs(
        rewards=rewards,
        group_indices=[s.group_index for s in samples],
        loss_masks=masks,
        kl=kl,
        values=scorers.critic(samples) if scorers.critic is not None else None,
        log_probs=full_old,
        teacher_log_probs=scorers.teacher(samples) if scorers.teacher is not None else None,
    )
    result = compute_advantages(algo, inputs, estimator)
    advantages = [a.float() for a in result.advantages]
    skipped = zero_gradient_samples(algo, advantages, masks) if skip_zero_gradient and not eager \
        else set()
    trained = steps_without(steps, skipped)
    if not eager and not algo.use_rollout_logprobs:
        _score_old(old, samples, scorers, trained[0], lazy=lazy,
                   needed={i for idx in trained for i in idx})
    return PreparedBatch(
        rewards=rewards,
        advantages=advantages,
        returns=[r.float() for r in result.returns],
        old_log_probs=old,
        ref_log_probs=ref,
        rollout_log_probs=rollout,
        values=inputs.values,
        opd_reverse_kl=result.opd_reverse_kl,
        response_lengths=lengths,
        steps=trained,
    )


def _score_old(
    old: list[Tensor | None], samples: list[Sample], scorers: Scorers, first_step: list[int],
    lazy: bool, needed: set[int] | None = None,
) -> None:
    """Fill `old` with the policy's log-probs of the `needed` samples (default: all): the
    first step's on their own (or, `lazy`, left to its forward), then the rest."""
    wanted = set(range(len(samples))) if needed is None else needed
    rest = sorted(wanted - set(first_step))
    for part in ([rest] if lazy else [list(first_step), rest]):
        if part:
            for i, lp in zip(part, scorers.policy([samples[i] for i in part]), strict=True):
                old[i] = lp
