"""Advantage estimators: pure functions from rewards to per-sample advantages.

GRPO needs no critic: each sample's advantage is its reward relative to the other samples of
the same prompt. We follow slime's reward post-processing exactly, because users compare
curves across frameworks:

    A_i = (r_i - mean(group)) / (std(group) + eps)        (std normalisation on, GRPO)
    A_i =  r_i - mean(group)                              (off: Dr. GRPO)

`std` is torch's default *unbiased* estimator (divides by k - 1), as in slime's
`rewards.std(dim=-1)`, and `eps` is added to the std, not under a square root. A group of one
sample has an undefined unbiased std; slime switches std normalisation off when
`n_samples_per_prompt == 1`, so here such a group simply gets advantage 0 (its centred reward).

GRPO broadcasts the scalar advantage to every response token (slime's `get_grpo_returns`);
that broadcast happens where per-token tensors are built, not here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def grpo_advantages(rewards: Tensor, std_normalization: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages for equally sized groups.

    `rewards` is `[n_groups, group_size]`; the result has the same shape and dtype float32.
    """
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be [n_groups, group_size], got shape {tuple(rewards.shape)}"
        )
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=-1, keepdim=True)
    if not std_normalization or rewards.shape[-1] < 2:
        return centred
    std = rewards.std(dim=-1, keepdim=True)  # unbiased, as slime
    return centred / (std + eps)


def grpo_advantages_by_group(
    rewards: Sequence[float],
    group_indices: Sequence[int],
    std_normalization: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Per-sample GRPO advantages where samples are tagged with their group.

    Samples may come in any order and groups may differ in size (e.g. after a per-sample
    filter), so this groups by `group_indices` instead of reshaping. Returns `[n]` float32 in
    the input order.
    """
    if len(rewards) != len(group_indices):
        raise ValueError(f"{len(rewards)} rewards but {len(group_indices)} group indices")
    values = torch.tensor(list(rewards), dtype=torch.float32)
    out = torch.empty_like(values)
    members: dict[int, list[int]] = {}
    for position, group in enumerate(group_indices):
        members.setdefault(int(group), []).append(position)
    for positions in members.values():
        idx = torch.tensor(positions, dtype=torch.long)
        out[idx] = grpo_advantages(values[idx].unsqueeze(0), std_normalization, eps).squeeze(0)
    return out


def rloo_advantages_by_group(rewards: Tensor, group_indices: Sequence[int]) -> Tensor:
    """Leave-one-out baseline: A_i = r_i - mean(r_j, j != i) = k / (k - 1) * (r_i - mean).

    A group of one sample has no other sample to compare with and gets 0.
    """
    out = torch.zeros(rewards.shape[0], dtype=torch.float32)
    for positions in _members(group_indices).values():
        idx = torch.tensor(positions, dtype=torch.long)
        k = len(positions)
        if k < 2:
            continue
        r = rewards[idx].float()
        out[idx] = (r * k - r.sum()) / (k - 1)
    return out


def group_mean_baseline(rewards: Tensor, group_indices: Sequence[int]) -> Tensor:
    """r_i - mean(group): REINFORCE++-baseline's scalar (before the KL term)."""
    return grpo_advantages_by_group(rewards.tolist(), group_indices, std_normalization=False)


def _members(group_indices: Sequence[int]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = {}
    for position, group in enumerate(group_indices):
        members.setdefault(int(group), []).append(position)
    return members


def discounted_returns(token_rewards: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over one 1-D response (REINFORCE++)."""
    out = torch.empty_like(token_rewards)
    running = token_rewards.new_zeros(())
    for t in range(token_rewards.shape[0] - 1, -1, -1):
        running = token_rewards[t] + gamma * running
        out[t] = running
    return out


def reinforce_plus_plus_returns(
    reward: float, kl: Tensor, loss_mask: Tensor, kl_coef: float, gamma: float
) -> Tensor:
    """slime's REINFORCE++ per-token returns for one sample.

    Token rewards are -kl_coef * kl, plus the scalar reward on the *last masked* token; the
    returns are their discounted suffix sums. A fully masked response has no token to carry
    the reward and is an error (slime asserts the same).
    """
    nonzero = loss_mask.nonzero()
    if nonzero.numel() == 0:
        raise ValueError("reinforce_plus_plus: a response has no loss-masked token")
    token_rewards = -kl_coef * kl.float()
    token_rewards[int(nonzero[-1])] += reward
    return discounted_returns(token_rewards, gamma)


def gae(rewards: Tensor, values: Tensor, gamma: float, lambd: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over one 1-D response; `(advantages, returns)`.

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token is 0),
    A_t = delta_t + gamma * lambd * A_{t+1},  returns = A + V.
    """
    adv = torch.empty_like(values, dtype=torch.float32)
    last = values.new_zeros((), dtype=torch.float32)
    n = values.shape[0]
    for t in range(n - 1, -1, -1):
        next_value = values[t + 1] if t < n - 1 else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lambd * last
        adv[t] = last
    return adv, adv + values.float()


def ppo_token_rewards(reward: float, kl: Tensor, kl_coef: float) -> Tensor:
    """PPO's per-token rewards: -kl_coef * kl, plus the scalar reward on the last token."""
    token_rewards = -kl_coef * kl.float()
    if token_rewards.numel():
        token_rewards[-1] += reward
    return token_rewards


def masked_whiten(values: list[Tensor], masks: list[Tensor], eps: float = 1e-8) -> list[Tensor]:
    """Normalise to zero mean / unit variance over all masked tokens of the batch.

    Population variance over masked tokens, `(x - mean) / sqrt(var + eps)` (slime's
    `distributed_masked_whiten` with shift_mean, on one process: every rank holds the whole
    rollout batch, so the statistics are global already).
    """
    flat = torch.cat([v.float() for v in values])
    mask = torch.cat([m.float() for m in masks])
    count = mask.sum().clamp_min(1.0)
    mean = (flat * mask).sum() / count
    var = (((flat - mean) ** 2) * mask).sum() / count
    whitened = (flat - mean) * torch.rsqrt(var + eps)
    return list(whitened.split([v.numel() for v in values]))
