"""The running batch of the embedded engine: per-request state, per-row tensors, KV cache.

Continuous batching with a Hugging Face model: every row of the batch is one request, left
padded, with its own attention-mask row and explicit position ids, so rows of different
lengths share one `KVCache` (preallocated buffers, one column written per step). New
requests are prefilled on their own and merged in by left-padding both caches to a common
length; finished rows ride along masked until they are a quarter of the batch, then the
batch (and cache) is compacted and columns that are padding for every row are trimmed.
Padding is masked out, so a row's log-probs equal a full-sequence forward of that request
alone. Per-token bookkeeping (lengths, stop tokens, which rows live) is plain Python over
the rows: at decode batch sizes a handful of list operations cost less than the tensor ops
(one dispatch each) they replace.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from engines.inference.gen_types import GenRequest
from engines.inference.kv_cache import KVCache, RowFinish
from engines.inference.sampling import SamplingRows, uniform_table

_COMPACT_BELOW = 0.75
_ROOM = 64  # free cache columns given to a new or rebuilt cache (at most what rows can use)
_UNIFORM_BLOCK = 32  # steps of sampling uniforms drawn at once
ROW_TENSORS = ("seeds", "temps", "top_p", "top_k", "next_pos", "last_tok")


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
    # MoE models: int16 `[tokens, layers, topk]` routed experts of the tokens fed so far
    # (the prefill's prefix, then one per decode step); a re-prefill replaces them
    routed: list[torch.Tensor] = field(default_factory=list)
    # (first output index, weight version) of each run of tokens: a weight update between two
    # decode steps (an `in_place` or `retract` pause) starts a new run
    version_spans: list[tuple[int, int]] = field(default_factory=list)

    def note_version(self, version: int) -> None:
        """The tokens from here on come from `version`."""
        if not self.version_spans or self.version_spans[-1][1] != version:
            if self.version_spans and self.version_spans[-1][0] == len(self.out_ids):
                self.version_spans.pop()  # no token came from the previous version
            self.version_spans.append((len(self.out_ids), version))

    @property
    def prefix(self) -> list[int]:
        return self.request.input_ids + self.out_ids


class DecodeBatch:
    """Requests waiting for prefill, and the rows being decoded with their KV cache."""

    def __init__(self, vocab: int = 0) -> None:
        self.waiting: deque[ReqState] = deque()
        self.vocab = vocab
        self.weight_version: int | None = None  # the version its requests' spans last noted
        self.drop_rows()

    def drop_rows(self) -> None:
        """Forget every row and the KV cache (waiting requests stay)."""
        self.rows: list[ReqState] = []
        self.alive: list[bool] = []
        self.n_alive = 0
        self.t: dict[str, torch.Tensor] = {}
        self.sampling: SamplingRows | None = None
        self.cache: KVCache | None = None
        self._uniforms = torch.zeros(0, 0)
        self._next_uniform = 0

    def __len__(self) -> int:
        return len(self.waiting) + self.n_alive

    @property
    def num_running(self) -> int:
        return self.n_alive

    def live_rows(self) -> list[int]:
        if self.n_alive == len(self.rows):
            return list(range(len(self.rows)))
        return [j for j, alive in enumerate(self.alive) if alive]

    def room(self) -> int:
        """Cache columns worth reserving: what the longest remaining budget can use."""
        left = max((s.budget - len(s.out_ids) for s in self.rows), default=0)
        return max(1, min(_ROOM, left))

    @classmethod
    def prefilled(
        cls,
        states: list[ReqState],
        attn: torch.Tensor,
        cache: DynamicCache | KVCache,
        vocab: int,
        rows: torch.Tensor | None = None,
    ) -> DecodeBatch:
        """Rows for requests just prefilled together (`attn` is the prefill's left-padded
        mask; `rows` maps each state to its prefill row when prompts were deduplicated);
        every row tensor lives on the model's device, beside the logits it is used with.
        `cache`: the HF forward's, or a `KVCache` a batch-invariant prefill built."""
        params = [s.request.params for s in states]
        dev = attn.device
        cache_attn = attn
        if rows is not None:
            attn = attn[rows]
        b = cls(vocab)
        b.rows = list(states)
        b.alive = [True] * len(states)
        b.n_alive = len(states)
        b.t = {
            "seeds": torch.tensor([s.seed for s in states], dtype=torch.long, device=dev),
            "temps": torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            "top_k": torch.tensor([vocab if p.top_k < 0 else p.top_k for p in params], device=dev),
            "next_pos": attn.sum(-1),
            "last_tok": torch.zeros(len(states), dtype=torch.long, device=dev),
        }
        b._rows_changed()
        if isinstance(cache, KVCache):
            pick = rows if rows is not None else torch.arange(len(states), device=dev)
            b.cache = cache.select(pick, 0, b.room())
        else:
            b.cache = KVCache.from_prefill(cache, cache_attn, b.room(), rows)
        return b

    def _rows_changed(self) -> None:
        t = self.t
        self.sampling = SamplingRows.of(t["temps"], t["top_p"], t["top_k"], self.vocab)
        self._next_uniform = _UNIFORM_BLOCK  # redraw for the new rows at the next token

    def uniforms(self, steps: int = 1) -> torch.Tensor | None:
        """Each row's sampling uniforms for its next `steps` tokens at most, `[steps, rows]`:
        `seeded_uniform(seed, tokens so far + i)` (None when every row is greedy). Every
        sample advances every row by one token, so a table for the next `_UNIFORM_BLOCK`
        tokens is read row by row; fewer than `steps` come back where the table ends.
        `used` moves past the ones a step took."""
        assert self.sampling is not None
        if self.sampling.all_greedy:
            return None
        if self._next_uniform >= _UNIFORM_BLOCK:
            seeds = self.t["seeds"]
            steps_done = torch.tensor([len(s.out_ids) for s in self.rows], device=seeds.device)
            # step-major, so that each step's uniforms are contiguous
            self._uniforms = uniform_table(seeds, steps_done, _UNIFORM_BLOCK).T.contiguous()
            self._next_uniform = 0
        return self._uniforms[self._next_uniform : self._next_uniform + steps]

    def used(self, steps: int) -> None:
        self._next_uniform += steps

    def finish_rules(self) -> RowFinish | None:
        """What ends each row, for steps decoded without Python in between; None if a live
        row has stop strings (matched on the text, in Python, after each token)."""
        live = self.live_rows()
        if any(self.rows[j].request.params.stop for j in live):
            return None
        width = max(1, max(len(s.stop_ids) for s in self.rows))
        dev = self.t["seeds"].device
        left = [s.budget - len(s.out_ids) for s in self.rows]
        return RowFinish(
            torch.tensor(self.alive, device=dev),
            torch.tensor(left, device=dev),
            torch.tensor([s.stop_ids + [-1] * (width - len(s.stop_ids)) for s in self.rows],
                         dtype=torch.long, device=dev),
            min(left[j] for j in live),
            max(left[j] for j in live),
        )  # fmt: skip

    def record(
        self,
        tok: torch.Tensor,
        logp: torch.Tensor,
        match_stop: Callable[[ReqState], str | None],
    ) -> list[ReqState]:
        """Append each live row's new tokens (`[steps, rows]`: only the last step may end a
        row); mark and return the rows that finished."""
        self.used(tok.shape[0])
        self.t["last_tok"] = tok[-1]
        toks, lps = tok.T.tolist(), logp.T.tolist()
        ended: list[int] = []
        for j in self.live_rows():
            row, new = self.rows[j], toks[j]
            row.out_ids += new
            row.out_logprobs += lps[j]
            token = new[-1]
            if len(row.out_ids) >= row.budget:
                row.reason = {"type": "length", "length": len(row.out_ids)}
            elif token in row.stop_ids:
                row.reason = {"type": "stop", "matched": token}
            elif row.request.params.stop and (matched := match_stop(row)) is not None:
                row.reason = {"type": "stop", "matched": matched}
            else:
                continue
            ended.append(j)
        return self.end_rows(ended)

    def end_rows(self, rows: list[int]) -> list[ReqState]:
        for j in rows:
            if self.alive[j]:
                self.alive[j] = False
                self.n_alive -= 1
        return [self.rows[j] for j in rows]

    def maybe_compact(self) -> None:
        if self.n_alive == 0:
            self.drop_rows()
        elif self.n_alive <= _COMPACT_BELOW * len(self.rows):
            self.compact()

    def compact(self) -> None:
        """Keep the live rows; trim cache columns that are padding for all of them."""
        live = self.live_rows()
        if len(live) == len(self.rows):
            return
        if not live:
            self.drop_rows()
            return
        assert self.cache is not None
        keep = torch.tensor(live, device=self.cache.mask.device)
        self.rows = [self.rows[j] for j in live]
        self.t = {k: v[keep] for k, v in self.t.items()}
        self.alive = [True] * len(live)
        self.n_alive = len(live)
        self._rows_changed()
        mask = self.cache.mask[keep, : self.cache.width]
        trim = int((mask.cumsum(-1) == 0).sum(-1).min())
        self.cache = self.cache.select(keep, trim, self.room())

    def merge(self, other: DecodeBatch) -> None:
        """Append `other`'s live rows; both caches are left-padded to a common length."""
        other.compact()
        if other.n_alive == 0:
            return
        if self.n_alive == 0:
            for name in ("rows", "alive", "n_alive", "t", "vocab", "cache"):
                setattr(self, name, getattr(other, name))
            self._rows_changed()
            return
        self.compact()
        assert self.cache is not None and other.cache is not None
        self.t = {k: torch.cat([v, other.t[k]]) for k, v in self.t.items()}
        self.cache = KVCache.concat(self.cache, other.cache, max(self.room(), other.room()))
        self.rows += other.rows
        self.n_alive += other.n_alive
        self.alive = [True] * len(self.rows)
        self._rows_changed()
