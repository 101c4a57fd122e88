"""SGLang's sampling semantics as pure tensor functions: seeded, batch-independent, exact.

Each request draws one uniform number per generated token from a counter-based hash of
(sampling_seed, token index) and inverts the CDF. The token index is per row, so a seeded
request samples the same tokens whatever else shares its batch and whenever it joined it
(continuous batching), with no per-row torch.Generator in the hot loop. Log-probs come from
the untruncated distribution in float32, as SGLang reports them.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """uint32 multiply on int64 tensors, split in 16-bit halves so nothing overflows."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_uniform(seeds: torch.Tensor, step: torch.Tensor | int) -> torch.Tensor:
    """A uniform in (0, 1) per row that depends only on (seed, step) of that row."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _mix32(_mix32(_mix32(lo) ^ hi) ^ (step & _M32))
    return ((h.double() + 0.5) / 2.0**32).float()


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    step: torch.Tensor | int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, log-probs before top-p/top-k truncation).

    `top_k` holds the vocabulary size where it is disabled; temperature 0 is greedy and
    reports the raw `log_softmax(logits)`. `step` is each row's count of generated tokens.
    """
    greedy = temperature <= 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    tokens = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return tokens, logp.gather(1, tokens[:, None])[:, 0]
    vocab = logits.shape[-1]
    order: torch.Tensor | None = None
    if bool((top_p < 1.0).any() or (top_k < vocab).any()):
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_logp.exp()
        keep = (torch.arange(vocab, device=logits.device)[None, :] < top_k[:, None]) & (
            (probs.cumsum(-1) - probs) <= top_p[:, None]
        )
        probs = probs * keep
    else:
        probs = logp.exp()
    cdf = probs.cumsum(-1)
    u = seeded_uniform(seeds, step)[:, None]
    pick = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
    # float32 rounding can put u * total on the last cdf step; never pick a zero-prob token.
    pick = torch.where(probs.gather(1, pick) > 0, pick, probs.argmax(-1, keepdim=True))
    sampled = (pick if order is None else order.gather(1, pick))[:, 0]
    tokens = torch.where(greedy, tokens, sampled)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]
