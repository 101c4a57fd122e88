"""The running batch of the embedded engine: per-request state, per-row tensors, KV cache.

Continuous batching with a Hugging Face model: every row of the batch is one request, left
padded, with its own attention-mask row and explicit position ids, so rows of different
lengths share one `KVCache` (preallocated buffers, one column written per step). New
requests are prefilled on their own and merged in by left-padding both caches to a common
length; finished rows ride along masked until they are a quarter of the batch, then the
batch (and cache) is compacted and columns that are padding for every row are trimmed.
Padding is masked out, so a row's log-probs equal a full-sequence forward of that request
alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from engines.rollout.gen_types import GenRequest
from engines.rollout.kv_decode import KVCache

_COMPACT_BELOW = 0.75
_ROOM = 64  # free cache columns given to a new or rebuilt cache (at most what rows can use)
ROW_TENSORS = ("seeds", "temps", "top_p", "top_k", "budgets", "steps", "next_pos", "last_tok")


@dataclass(slots=True)
class ReqState:
    """One request inside the engine; its output survives retraction (re-prefill)."""

    request: GenRequest
    seed: int
    budget: int
    stop_ids: list[int]
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    reason: dict[str, Any] | None = None

    @property
    def prefix(self) -> list[int]:
        return self.request.input_ids + self.out_ids


class DecodeBatch:
    """Requests waiting for prefill, and the rows being decoded with their KV cache."""

    def __init__(self) -> None:
        self.waiting: deque[ReqState] = deque()
        self.drop_rows()

    def drop_rows(self) -> None:
        """Forget every row and the KV cache (waiting requests stay)."""
        self.rows: list[ReqState] = []
        self.alive = torch.zeros(0, dtype=torch.bool)
        self.n_alive = 0
        self.t: dict[str, torch.Tensor] = {}
        self.stop_ids = torch.zeros(0, 1, dtype=torch.long)
        self.cache: KVCache | None = None

    def __len__(self) -> int:
        return len(self.waiting) + self.n_alive

    @property
    def num_running(self) -> int:
        return self.n_alive

    def room(self) -> int:
        """Cache columns worth reserving: what the longest remaining budget can use."""
        left = int((self.t["budgets"] - self.t["steps"]).max()) if self.rows else 0
        return max(1, min(_ROOM, left))

    @classmethod
    def prefilled(
        cls, states: list[ReqState], attn: torch.Tensor, cache: DynamicCache, vocab: int
    ) -> DecodeBatch:
        """Rows for requests just prefilled together (`attn` is their left-padded mask);
        every row tensor lives on the model's device, beside the logits it is used with."""
        params = [s.request.params for s in states]
        width = max(1, max(len(s.stop_ids) for s in states))
        dev = attn.device
        b = cls()
        b.rows = list(states)
        b.alive = torch.ones(len(states), dtype=torch.bool, device=dev)
        b.n_alive = len(states)
        b.stop_ids = torch.tensor(
            [s.stop_ids + [-1] * (width - len(s.stop_ids)) for s in states], device=dev
        )
        b.t = {
            "seeds": torch.tensor([s.seed for s in states], dtype=torch.long, device=dev),
            "temps": torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            "top_k": torch.tensor([vocab if p.top_k < 0 else p.top_k for p in params], device=dev),
            "budgets": torch.tensor([s.budget for s in states], device=dev),
            "steps": torch.tensor([len(s.out_ids) for s in states], device=dev),
            "next_pos": attn.sum(-1),
            "last_tok": torch.zeros(len(states), dtype=torch.long, device=dev),
        }
        b.cache = KVCache.from_prefill(cache, attn, b.room())
        return b

    def record(
        self,
        tok: torch.Tensor,
        logp: torch.Tensor,
        match_stop: Callable[[ReqState], str | None],
    ) -> list[ReqState]:
        """Append each live row's new token; mark and return the rows that finished."""
        t, alive = self.t, self.alive
        t["steps"] += 1
        t["last_tok"] = tok
        toks, lps, steps = tok.tolist(), logp.tolist(), t["steps"].tolist()
        live = alive.nonzero()[:, 0].tolist()
        for j in live:
            self.rows[j].out_ids.append(toks[j])
            self.rows[j].out_logprobs.append(lps[j])
        hit_len = (t["steps"] >= t["budgets"]) & alive
        hit_stop = (tok[:, None] == self.stop_ids).any(-1) & alive & ~hit_len
        ended: list[int] = []
        for j in hit_len.nonzero()[:, 0].tolist():
            self.rows[j].reason = {"type": "length", "length": steps[j]}
            ended.append(j)
        for j in hit_stop.nonzero()[:, 0].tolist():
            self.rows[j].reason = {"type": "stop", "matched": toks[j]}
            ended.append(j)
        for j in live:
            row = self.rows[j]
            if row.reason is None and row.request.params.stop:
                matched = match_stop(row)
                if matched is not None:
                    row.reason = {"type": "stop", "matched": matched}
                    ended.append(j)
        return self.end_rows(ended)

    def end_rows(self, rows: list[int]) -> list[ReqState]:
        if rows:
            self.alive[rows] = False
            self.n_alive = int(self.alive.sum())
        return [self.rows[j] for j in rows]

    def maybe_compact(self) -> None:
        if self.n_alive == 0:
            self.drop_rows()
        elif self.n_alive <= _COMPACT_BELOW * len(self.rows):
            self.compact()

    def compact(self) -> None:
        """Keep the live rows; trim cache columns that are padding for all of them."""
        keep = self.alive.nonzero()[:, 0]
        if len(keep) == len(self.rows):
            return
        if len(keep) == 0:
            self.drop_rows()
            return
        self.rows = [self.rows[j] for j in keep.tolist()]
        self.t = {k: v[keep] for k, v in self.t.items()}
        self.stop_ids = self.stop_ids[keep]
        self.alive = torch.ones(len(keep), dtype=torch.bool, device=keep.device)
        assert self.cache is not None
        mask = self.cache.mask[keep, : self.cache.width]
        trim = int((mask.cumsum(-1) == 0).sum(-1).min())
        self.cache = self.cache.select(keep, trim, self.room())

    def merge(self, other: DecodeBatch) -> None:
        """Append `other`'s live rows; both caches are left-padded to a common length."""
        other.compact()
        if other.n_alive == 0:
            return
        if self.n_alive == 0:
            for name in ("rows", "alive", "n_alive", "t", "stop_ids", "cache"):
                setattr(self, name, getattr(other, name))
            return
        self.compact()
        assert self.cache is not None and other.cache is not None
        stops = max(self.stop_ids.shape[1], other.stop_ids.shape[1])
        self.stop_ids = torch.cat(
            [F.pad(s, (0, stops - s.shape[1]), value=-1) for s in (self.stop_ids, other.stop_ids)]
        )
        self.t = {k: torch.cat([v, other.t[k]]) for k, v in self.t.items()}
        self.cache = KVCache.concat(self.cache, other.cache, max(self.room(), other.room()))
        self.rows += other.rows
        self.n_alive += other.n_alive
        self.alive = torch.ones(len(self.rows), dtype=torch.bool, device=other.alive.device)
