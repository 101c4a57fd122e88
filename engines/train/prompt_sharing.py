"""Shared-prompt batches: each distinct prompt is computed once for all of its responses.

GRPO-style groups hold `n_samples_per_prompt` responses to one prompt, and a padded batch
runs that prompt through the model once per response. Here a micro-batch becomes one input
row per distinct prompt,

    row g:  [ prompt | response 1 | response 2 | ... ]      positions 0..P-1 | P.. | P.. | ...

under an attention mask that lets a prompt token see the earlier prompt tokens and a
response token see the whole prompt and its own earlier tokens, nothing else. Every token
then sees exactly the keys (at the same positions) it would see in its own padded row, so
log-probs, entropies and gradients are those of the padded batch up to float rounding, for
~P x (n - 1) fewer tokens per group: short responses to a longer prompt gain the most
(bench/RESULTS.md, "Train step").

Needs attention that takes a custom 4-D mask and explicit position ids: Hugging Face's
`sdpa` (the default on CPU and GPU) does. `supports_prompt_sharing` says when to use it; the
padded batch (`batching.build_padded_batch`) is the fallback and gives the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from engines.train.batching import (
    PaddedBatch,
    build_padded_batch,
    padded_rows,
)
from engines.train.flash_attention import ATTENTION_NAME
from storage.sample import Sample

_PROMPT, _PAD = -1, -2  # segment ids; response k of a row has segment k >= 0
# implementations that honour a custom boolean 4-D mask (flash_attention's falls back to sdpa)
_ATTENTION = ("sdpa", ATTENTION_NAME)


def supports_prompt_sharing(model: nn.Module) -> bool:
    """True when `model` (or the module it wraps) is a transformers model on sdpa attention."""
    inner = getattr(model, "module", model)  # DDP
    config = getattr(inner, "config", None)
    return getattr(config, "_attn_implementation", None) in _ATTENTION


@dataclass(slots=True)
class PromptRow:
    """One unpadded input row: token ids, positions and segment ids (`_PROMPT` for the
    shared part, k >= 0 for response k), and for each sample on it (`slots`: sample ->
    in-row positions whose logits predict its response tokens)."""

    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seg: list[int] = field(default_factory=list)
    slots: dict[int, list[int]] = field(default_factory=dict)


def prompt_rows(samples: Sequence[Sample], share: bool = True) -> list[PromptRow]:
    """`samples` (validated) as unpadded rows: one per distinct prompt with its responses
    after it when `share`, else one per sample (a plain causal row: every token `_PROMPT`)."""
    if not samples:
        raise ValueError("cannot build a batch from zero samples")
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, s in enumerate(samples):
        if s.prompt_length < 1:
            raise ValueError(f"sample {s.index}: needs at least one prompt token")
        if len(s.loss_mask) != s.response_length:
            raise ValueError(
                f"sample {s.index}: loss_mask has {len(s.loss_mask)} != {s.response_length} entries"
            )
        key = tuple(s.tokens[: s.prompt_length]) if share else (-1 - i,)
        groups.setdefault(key, []).append(i)
    rows = []
    for idx in groups.values():
        first = samples[idx[0]]
        prompt = first.tokens if not share else first.tokens[: first.prompt_length]
        p = at = len(prompt)
        row = PromptRow(list(prompt), list(range(p)), [_PROMPT] * p)
        if not share:  # the whole sample is one causal segment
            r = first.response_length
            row.slots[idx[0]] = list(range(first.prompt_length - 1, first.prompt_length - 1 + r))
            rows.append(row)
            continue
        for k, i in enumerate(idx):
            s = samples[i]
            r = s.response_length
            row.ids += s.response_tokens
            row.pos += range(p, p + r)
            row.seg += [k] * r
            # slot 0 is predicted by the prompt's last token, slot t by response token t - 1
            row.slots[i] = [p - 1, *range(at, at + r - 1)] if r else []
            at += r
        rows.append(row)
    return rows


def build_shared_prompt_batch(samples: Sequence[Sample], pad_token_id: int = 0) -> PaddedBatch:
    """`samples` as one row per distinct prompt (see the module docstring); response-space
    tensors are per sample, in `samples` order, exactly as `build_padded_batch` makes them.
    Without a repeated prompt it is `build_padded_batch` (e.g. SFT batches)."""
    rows = prompt_rows(samples)
    if len(rows) == len(samples):  # no prompt repeats: nothing to share
        return build_padded_batch(samples, pad_token_id)
    width = max(len(row.ids) for row in rows)
    resp = max(max(s.response_length for s in samples), 1)
    row_of: list[int] = [0] * len(samples)
    slots_of: list[list[int]] = [[] for _ in samples]
    for r, row in enumerate(rows):
        for i, slots in row.slots.items():
            row_of[i], slots_of[i] = r, slots
    ids = padded_rows([row.ids for row in rows], width, pad_token_id, torch.long)
    pos = padded_rows([row.pos for row in rows], width, 0, torch.long)
    seg = padded_rows([row.seg for row in rows], width, _PAD, torch.long)
    logit_row = padded_rows(
        [[row_of[i]] * len(slots) for i, slots in enumerate(slots_of)], resp, 0, torch.long
    )
    logit_index = padded_rows(slots_of, resp, 0, torch.long)
    return PaddedBatch.of_samples(
        samples, ids, shared_prompt_mask(seg), logit_index, position_ids=pos, logit_row=logit_row
    )


def shared_prompt_mask(segments: torch.Tensor) -> torch.Tensor:
    """`[rows, L]` segment ids -> `[rows, 1, L, L]` boolean mask (True: may attend).

    Causal, and a query sees a key when the key is a prompt token or both are the same
    response. Padding (at a row's end) sees the prompt too, so no softmax row is empty (that
    would be NaN, and NaN leaks into gradients); it never sees itself, which is how
    `PaddedBatch.num_tokens` tells it from real tokens."""
    width = segments.shape[1]
    q, k = segments.unsqueeze(2), segments.unsqueeze(1)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    return (causal & ((k == _PROMPT) | ((q == k) & (q >= 0)))).unsqueeze(1)
