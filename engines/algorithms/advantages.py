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
