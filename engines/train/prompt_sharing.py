"""Shared-prompt batches: each distinct prompt is computed once for all of its responses.

GRPO-style groups hold `n_samples_per_prompt` responses to one prompt, and a padded batch
runs that prompt through the model once per response. Here a micro-batch becomes one input
row per distinct prompt,

    row g:  [ prompt | response 1 | response 2 | ... ]      positions 0..P-1 | P.. | P.. | ...

under an attention mask that lets a prompt token see the earlier prompt tokens and a
response token see the whole prompt and its own earlier tokens, nothing else. Every token
then sees exactly the keys (at the same positions) it would see in its own padded row, so
log-probs, entropies and gradients are those of the padded batch up to float rounding, for
~P x (n - 1) fewer tokens per group: on the arithmetic example (6-token prompts, ~4-token
responses, 8 per prompt) a forward + backward costs ~2.3x less.

Needs attention that takes a custom 4-D mask and explicit position ids: Hugging Face's
`sdpa` (the default on CPU and GPU) does. `supports_prompt_sharing` says when to use it; the
padded batch (`batching.build_padded_batch`) is the fallback and gives the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from engines.train.batching import PaddedBatch, build_padded_batch
from storage.sample import Sample

_PROMPT, _PAD = -1, -2  # segment ids; response k of a row has segment k >= 0
_ATTENTION = ("sdpa",)  # implementations that honour a custom boolean 4-D mask


def supports_prompt_sharing(model: nn.Module) -> bool:
    """True when `model` (or the module it wraps) is a transformers model on sdpa attention."""
    inner = getattr(model, "module", model)  # DDP
    config = getattr(inner, "config", None)
    return getattr(config, "_attn_implementation", None) in _ATTENTION


def build_shared_prompt_batch(samples: Sequence[Sample], pad_token_id: int = 0) -> PaddedBatch:
    """`samples` as one row per distinct prompt (see the module docstring); response-space
    tensors are per sample, in `samples` order, exactly as `build_padded_batch` makes them.
    Without a repeated prompt it is `build_padded_batch` (e.g. SFT batches)."""
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
        groups.setdefault(tuple(s.tokens[: s.prompt_length]), []).append(i)
    if len(groups) == len(samples):  # no prompt repeats: nothing to share
        return build_padded_batch(samples, pad_token_id)
    width = max(len(p) + sum(samples[i].response_length for i in idx) for p, idx in groups.items())
    resp = max(max(s.response_length for s in samples), 1)
    n = len(samples)
    ids = [[pad_token_id] * width for _ in groups]
    pos = [[0] * width for _ in groups]
    seg = [[_PAD] * width for _ in groups]
    logit_row = [[0] * resp for _ in range(n)]
    logit_index = [[0] * resp for _ in range(n)]
    targets = [[0] * resp for _ in range(n)]
    response_mask = [[0.0] * resp for _ in range(n)]
    loss_mask = [[0.0] * resp for _ in range(n)]
    for row, (prompt, idx) in enumerate(groups.items()):
        p = at = len(prompt)
        ids[row][:p], pos[row][:p], seg[row][:p] = prompt, range(p), [_PROMPT] * p
        for k, i in enumerate(idx):
            s = samples[i]
            r, tokens = s.response_length, s.response_tokens
            if r == 0:
                continue
            ids[row][at : at + r], pos[row][at : at + r] = tokens, range(p, p + r)
            seg[row][at : at + r] = [k] * r
            # slot 0 is predicted by the prompt's last token, slot t by response token t - 1
            logit_row[i][:r], logit_index[i][:r] = [row] * r, [p - 1, *range(at, at + r - 1)]
            targets[i][:r], response_mask[i][:r] = tokens, [1.0] * r
            loss_mask[i][:r] = [float(m) for m in s.loss_mask]
            at += r
    return PaddedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        attention_mask=shared_prompt_mask(torch.tensor(seg, dtype=torch.long)),
        logit_index=torch.tensor(logit_index, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
        response_mask=torch.tensor(response_mask, dtype=torch.float32),
        loss_mask=torch.tensor(loss_mask, dtype=torch.float32),
        response_lengths=tuple(s.response_length for s in samples),
        position_ids=torch.tensor(pos, dtype=torch.long),
        logit_row=torch.tensor(logit_row, dtype=torch.long),
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
