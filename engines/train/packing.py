"""Sequence packing: a micro-batch's samples laid end to end instead of padded to its longest.

A padded micro-batch computes `count x longest` tokens; rollouts vary in length (GRPO
responses of one prompt easily differ 2x), so a good part of that is padding. Here the
unpadded rows of `prompt_sharing.prompt_rows` (one per prompt with its responses, or one
per sample) are packed end to end:

    rows mode (the torch backend, HF sdpa):   first-fit decreasing into rows under a
        block-diagonal 4-D mask (a token sees only its own unit, and in it what
        `shared_prompt_mask` allows), positions restarting per unit; only row tails are
        padded. A masked SDPA computes every query/key pair of its row, so wider rows pad
        less but cost more attention: `row_width` weighs the two (default: the longest unit,
        whose attention is no larger than the padded batch's).
    varlen mode (megatron, flash varlen attention):   one row of exactly the real tokens,
        units as plain causal sequences given by `cu_seqlens` (no mask is built; a [T, T]
        mask would cost T^2 memory and dense attention).

Every token sees exactly the keys, at the same positions, it sees in its padded row, so
log-probs, entropies and gradients equal the padded batch's up to float rounding; response
space (`[B, R]` targets and masks) is the padded batch's, only `logit_row` / `logit_index`
point into the packed rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from engines.train.batching import PaddedBatch
from engines.train.prompt_sharing import _PAD, PromptRow, prompt_rows, shared_prompt_mask
from storage.sample import Sample


def build_packed_batch(
    samples: Sequence[Sample], pad_token_id: int = 0, share_prompts: bool = True,
    varlen: bool = False, hidden_size: int | None = None,
) -> PaddedBatch:
    """`samples` packed (see the module docstring). `varlen`: one row, no shared prompts,
    `cu_seqlens` set and `attention_mask` all ones `[1, T]` (for attention that takes
    `cu_seqlens`; NOT a causal-LM mask). `hidden_size`: the model's, to choose the row width
    (`row_width`); None packs into rows as wide as the longest unit."""
    units = prompt_rows(samples, share=share_prompts and not varlen)
    lengths = [len(u.ids) for u in units]
    if varlen:
        bins = [list(range(len(units)))]
    else:
        width = max(lengths) if hidden_size is None else row_width(lengths, hidden_size)
        bins = first_fit(lengths, width)
    width = max(sum(len(units[u].ids) for u in b) for b in bins)
    rows = len(bins)
    ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
    pos = torch.zeros((rows, width), dtype=torch.long)
    seg = torch.full((rows, width), _PAD, dtype=torch.long)
    unit = torch.zeros((rows, width), dtype=torch.long)
    resp = max(max(s.response_length for s in samples), 1)
    logit_row = torch.zeros((len(samples), resp), dtype=torch.long)
    logit_index = torch.zeros((len(samples), resp), dtype=torch.long)
    starts = [0]
    for r, members in enumerate(bins):
        at = 0
        for u in members:
            _place(units[u], r, at, ids, pos, seg, logit_row, logit_index)
            n = len(units[u].ids)
            unit[r, at:] = u  # padding at the row's end joins the last unit (see packed_mask)
            at += n
            starts.append(starts[-1] + n)
    if varlen:
        mask = torch.ones((1, width), dtype=torch.long)
        cu: Tensor | None = torch.tensor(starts, dtype=torch.int32)
    else:
        mask, cu = packed_mask(seg, unit), None
    return PaddedBatch.of_samples(
        samples, ids, mask, logit_index, position_ids=pos, logit_row=logit_row, cu_seqlens=cu
    )


def _place(
    row: PromptRow, r: int, at: int, ids: Tensor, pos: Tensor, seg: Tensor,
    logit_row: Tensor, logit_index: Tensor,
) -> None:
    """Write unit `row` into packed row `r` from column `at`."""
    n = len(row.ids)
    ids[r, at : at + n] = torch.tensor(row.ids, dtype=torch.long)
    pos[r, at : at + n] = torch.tensor(row.pos, dtype=torch.long)
    seg[r, at : at + n] = torch.tensor(row.seg, dtype=torch.long)
    for i, slots in row.slots.items():
        logit_row[i, : len(slots)] = r
        logit_index[i, : len(slots)] = torch.tensor(slots, dtype=torch.long) + at


def packed_mask(segments: Tensor, units: Tensor) -> Tensor:
    """`[rows, L]` segment and unit ids -> `[rows, 1, L, L]` boolean mask: the shared-prompt
    rule inside a unit, nothing across units. Tail padding carries its row's last unit id,
    so it sees that unit's prompt tokens (no empty softmax row) and never itself."""
    same = units.unsqueeze(2) == units.unsqueeze(1)
    return shared_prompt_mask(segments) & same.unsqueeze(1)


def model_hidden_size(model: nn.Module) -> int | None:
    """`config.hidden_size` of a transformers model (or of the module DDP wraps), if any."""
    config = getattr(getattr(model, "module", model), "config", None)
    size = getattr(config, "hidden_size", None)
    return size if isinstance(size, int) else None


def row_width(lengths: Sequence[int], hidden_size: int, max_factor: int = 8) -> int:
    """The row capacity (k x the longest unit, k <= `max_factor`) of least estimated cost:
    per row, width x (1 + width / (6 x hidden)) -- its matmuls (~6N FLOPs a token, N ~ 12
    hidden^2 a layer) plus a masked attention over all width^2 pairs (~12 hidden a pair and
    layer, forward and backward)."""
    longest, best = max(lengths), (math.inf, 0)
    for k in range(1, max_factor + 1):
        bins = first_fit(lengths, k * longest)
        width = max(sum(lengths[i] for i in b) for b in bins)
        cost = len(bins) * width * (1 + width / (6 * hidden_size))
        best = min(best, (cost, k * longest))
        if len(bins) == 1:
            break
    return best[1]


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` in bins of total at most `capacity` (first fit, longest first);
    an item longer than `capacity` gets a bin of its own."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins
