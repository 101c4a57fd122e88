"""SGLang's sampling semantics as pure tensor functions: seeded, batch-independent, exact.

Each request draws one uniform number per generated token from a counter-based hash of
(sampling_seed, token index) and inverts the CDF. The token index is per row, so a seeded
request samples the same tokens whatever else shares its batch and whenever it joined it
(continuous batching), with no per-row torch.Generator in the hot loop. Log-probs come from
the untruncated distribution in float32, as SGLang reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def uniform_table(seeds: torch.Tensor, steps: torch.Tensor, count: int) -> torch.Tensor:
    """`[rows, count]`: row i's uniforms for its tokens `steps[i]` .. `steps[i] + count - 1`
    (the hash is ~60 small ops: drawn for a block of steps at once, not once per token)."""
    ahead = torch.arange(count, device=seeds.device)
    return seeded_uniform(seeds[:, None], steps[:, None] + ahead)


@dataclass(frozen=True, slots=True)
class SamplingRows:
    """Each row's sampling parameters, with the batch-wide facts a step would otherwise
    find with a reduction per token: which work no row needs."""

    temperature: torch.Tensor  # [rows]
    top_p: torch.Tensor  # [rows]
    top_k: torch.Tensor  # [rows], the vocabulary size where top-k is off
    divisor: torch.Tensor | None  # [rows, 1]: temperature, 1 for greedy rows; None if all 1
    greedy: torch.Tensor | None  # bool [rows]; None when no row is greedy
    all_greedy: bool
    truncates: bool  # some row has top-p < 1 or top-k < vocab

    @classmethod
    def of(
        cls, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, vocab: int
    ) -> SamplingRows:
        greedy = temperature <= 0
        divisor = torch.where(greedy, 1.0, temperature)[:, None]
        return cls(
            temperature, top_p, top_k,
            None if bool((divisor == 1.0).all()) else divisor,
            greedy if bool(greedy.any()) else None,
            bool(greedy.all()),
            bool((top_p < 1.0).any() or (top_k < vocab).any()),
        )  # fmt: skip


def sample_tokens(
    logits: torch.Tensor, rows: SamplingRows, uniform: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, log-probs before top-p/top-k truncation).

    Temperature 0 is greedy and reports the raw `log_softmax(logits)`. `uniform` holds each
    row's `seeded_uniform(seed, tokens generated so far)` (None when every row is greedy).
    """
    logp = torch.log_softmax(logits if rows.divisor is None else logits / rows.divisor, dim=-1)
    if rows.all_greedy or uniform is None:
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(1, tokens[:, None])[:, 0]
    vocab = logits.shape[-1]
    order: torch.Tensor | None = None
    if rows.truncates:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        probs = sorted_logp.exp()
        keep = (torch.arange(vocab, device=logits.device)[None, :] < rows.top_k[:, None]) & (
            (probs.cumsum(-1) - probs) <= rows.top_p[:, None]
        )
        probs = probs * keep
    else:
        probs = logp.exp()
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True).clamp_(max=vocab - 1)
    # float32 rounding can put u * total on the last cdf step; never pick a zero-prob token.
    pick = torch.where(probs.gather(1, pick) > 0, pick, probs.argmax(-1, keepdim=True))
    tokens = (pick if order is None else order.gather(1, pick))[:, 0]
    if rows.greedy is not None:
        tokens = torch.where(rows.greedy, logits.argmax(dim=-1), tokens)
    return tokens, logp.gather(1, tokens[:, None])[:, 0]
