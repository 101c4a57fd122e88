"""A transformers model that decodes like SGLang: batched, KV-cached, with per-token log-probs.

The embedded engine lets the SGLang client, the router and the abort/partial-rollout path run
for real on CPU. Its log-probs must equal what the trainer recomputes (a plain full-sequence
forward), so prompts are left-padded with an explicit attention mask *and* position ids, and
log-probs come from the untruncated distribution in float32, as SGLang reports them.

Sampling draws one uniform number per (request, step) from a counter-based hash of
(sampling_seed, step) and inverts the CDF: no per-row torch.Generator in the hot loop, and a
seeded request samples the same tokens whatever else shares its batch.

The request/result records and the `Generator` protocol live in this, the reference backend.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ShouldAbort = Callable[[str], bool]
_M32 = 0xFFFFFFFF
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_COMPACT_BELOW = 0.75


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The subset of SGLang's sampling parameters the embedded engines implement."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 0, "must be >= 0"),
            ("temperature", self.temperature >= 0.0, "must be >= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "must be -1 (disabled) or >= 1"),
            ("sampling_seed", -(2**63) <= (self.sampling_seed or 0) < 2**63, "must fit int64"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"sampling_params.{name} {rule}, got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class GenRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass(frozen=True, slots=True)
class GenResult:
    """One finished (or aborted) request; `finish_reason` has SGLang's shape."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: dict[str, Any]
    prompt_tokens: int
    weight_version: int


class Generator(Protocol):
    """What the HTTP server and the engine actor need from a backend."""

    @property
    def weight_version(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def generate(
        self, requests: list[GenRequest], should_abort: ShouldAbort
    ) -> list[GenResult]: ...

    def tokenize(self, text: str) -> list[int]: ...

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...

    def update_weights_from_disk(self, model_path: str, version: int | None) -> None: ...

    def model_info(self) -> dict[str, Any]: ...


def never_abort(rid: str) -> bool:
    return False


def finish_text(
    tokenizer: Any, output_ids: list[int], reason: dict[str, Any], params: SamplingParams
) -> str:
    """Detokenize like SGLang with `no_stop_trim=False`: the matched stop is not in the text."""
    ids = output_ids
    matched = reason.get("matched")
    if not params.no_stop_trim and isinstance(matched, int) and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if not params.no_stop_trim and isinstance(matched, str) and (pos := text.find(matched)) >= 0:
        text = text[:pos]
    return text


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """uint32 multiply on int64 tensors, split in 16-bit halves so nothing overflows."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def seeded_uniform(seeds: torch.Tensor, step: int) -> torch.Tensor:
    """A uniform in (0, 1) per row that depends only on (seed, step)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    h = _mix32(_mix32(_mix32(lo) ^ hi) ^ (step & _M32))
    return ((h.double() + 0.5) / 2.0**32).float()


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    seeds: torch.Tensor,
    step: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; return (tokens, log-probs before top-p/top-k truncation).

    `top_k` holds the vocabulary size where it is disabled; temperature 0 is greedy and
    reports the raw `log_softmax(logits)`.
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
        keep = (torch.arange(vocab)[None, :] < top_k[:, None]) & (
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


@dataclass(slots=True)
class _Batch:
    """Per-request sampling tensors and output buffers of one decode batch."""

    requests: list[GenRequest]
    prompt_lens: torch.Tensor
    budgets: torch.Tensor
    seeds: torch.Tensor
    temps: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    stop_ids: torch.Tensor
    stop_window: dict[int, int]
    tokens: torch.Tensor
    logprobs: torch.Tensor
    lengths: torch.Tensor
    reasons: list[dict[str, Any] | None]


class EmbeddedGenerator:
    """An HF causal LM served with SGLang's sampling semantics; thread-safe per call."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        max_batch_size: int = 1024,
        num_threads: int | None = None,
        seed: int = 0,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_path = self.tokenizer_path = model_path
        self.max_batch_size = max_batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype])
        self.model.eval().requires_grad_(False)
        self.context_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(self.model.config.vocab_size)
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids = {i for i in [self.tokenizer.eos_token_id, *gen_eos] if i is not None}
        self._pad_id = self.tokenizer.pad_token_id or 0
        self._rng = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()
        self._version = 0

    @property
    def weight_version(self) -> int:
        return self._version

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "weight_version": self._version,
        }

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Copy a full state dict in place, after the running batch. Keys and shapes are
        checked first: `load_state_dict` raises only after copying what matched."""
        current = self.model.state_dict()
        missing, unexpected = current.keys() - state_dict.keys(), state_dict.keys() - current.keys()
        reshaped = [
            k for k in current.keys() & state_dict.keys() if state_dict[k].shape != current[k].shape
        ]
        if missing or unexpected or reshaped:
            raise ValueError(
                f"state dict does not match the model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}, wrong shape {sorted(reshaped)[:5]}"
            )
        with self._lock, torch.no_grad():
            self.model.load_state_dict(state_dict, strict=True)
            self._version = version

    def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        loaded = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.model.dtype)
        self.update_weights(loaded.state_dict(), self._version if version is None else version)
        self.model_path = model_path

    def generate(
        self, requests: list[GenRequest], should_abort: ShouldAbort = never_abort
    ) -> list[GenResult]:
        results: list[GenResult] = []
        with self._lock, torch.inference_mode():
            for start in range(0, len(requests), self.max_batch_size):
                chunk = requests[start : start + self.max_batch_size]
                results.extend(self._generate_batch(chunk, should_abort))
        return results

    def _new_batch(self, requests: list[GenRequest]) -> _Batch:
        params = [r.params for r in requests]
        budgets = [
            max(0, min(p.max_new_tokens, self.context_len - len(r.input_ids)))
            for r, p in zip(requests, params, strict=True)
        ]
        stops = [
            list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_ids)) for p in params
        ]
        stop_width = max(1, max(len(s) for s in stops))
        fresh = iter(torch.randint(0, 2**62, (len(params),), generator=self._rng).tolist())
        seeds = [next(fresh) if p.sampling_seed is None else p.sampling_seed for p in params]
        n, steps = len(requests), max(1, max(budgets))
        return _Batch(
            requests=requests,
            prompt_lens=torch.tensor([len(r.input_ids) for r in requests]),
            budgets=torch.tensor(budgets),
            seeds=torch.tensor(seeds, dtype=torch.long),
            temps=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_k=torch.tensor([self.vocab_size if p.top_k < 0 else p.top_k for p in params]),
            stop_ids=torch.tensor([s + [-1] * (stop_width - len(s)) for s in stops]),
            stop_window={i: max(map(len, p.stop)) + 1 for i, p in enumerate(params) if p.stop},
            tokens=torch.zeros(n, steps, dtype=torch.long),
            logprobs=torch.zeros(n, steps, dtype=torch.float32),
            lengths=torch.zeros(n, dtype=torch.long),
            reasons=[{"type": "length", "length": 0} if b == 0 else None for b in budgets],
        )

    def _generate_batch(
        self, requests: list[GenRequest], should_abort: ShouldAbort
    ) -> list[GenResult]:
        batch = self._new_batch(requests)
        rows = [i for i, reason in enumerate(batch.reasons) if reason is None]
        if rows:
            self._decode(batch, torch.tensor(rows, dtype=torch.long), should_abort)
        return self._results(batch)

    def _decode(self, b: _Batch, rows: torch.Tensor, should_abort: ShouldAbort) -> None:
        """Prefill the live rows, then decode until every row has a finish reason.

        `rows` maps batch positions to request indices; finished rows ride along masked
        until they are a quarter of the batch, then the batch (and KV cache) is compacted.
        """
        prompts = [torch.tensor(b.requests[i].input_ids) for i in rows.tolist()]
        ids = torch.nn.utils.rnn.pad_sequence(
            prompts, batch_first=True, padding_value=self._pad_id, padding_side="left"
        )
        width = ids.shape[1]
        attn = (torch.arange(width)[None, :] >= width - b.prompt_lens[rows][:, None]).long()
        positions = (attn.cumsum(-1) - 1).clamp_(min=0)
        next_pos = b.prompt_lens[rows].clone()
        out = self.model(
            input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
        cache = out.past_key_values
        alive = torch.ones(len(rows), dtype=torch.bool)
        step = 0
        while True:
            logits = out.logits[:, -1, :].float()
            tok, logp = sample_tokens(
                logits, b.temps[rows], b.top_p[rows], b.top_k[rows], b.seeds[rows], step
            )
            live_rows = rows[alive]
            b.tokens[live_rows, step] = tok[alive]
            b.logprobs[live_rows, step] = logp[alive]
            b.lengths[live_rows] = step + 1
            step += 1
            row_ids = rows.tolist()
            hit_len = (b.budgets[rows] <= step) & alive
            hit_stop = (tok[:, None] == b.stop_ids[rows]).any(-1) & alive & ~hit_len
            for j in hit_len.nonzero()[:, 0].tolist():
                b.reasons[row_ids[j]] = {"type": "length", "length": step}
            for j in hit_stop.nonzero()[:, 0].tolist():
                b.reasons[row_ids[j]] = {"type": "stop", "matched": int(tok[j])}
            alive &= ~(hit_stop | hit_len)
            ended = []
            for j in alive.nonzero()[:, 0].tolist():
                i = row_ids[j]
                matched = self._match_stop(b, i, step) if i in b.stop_window else None
                if matched is not None:
                    b.reasons[i] = {"type": "stop", "matched": matched}
                elif should_abort(b.requests[i].rid):
                    b.reasons[i] = {"type": "abort", "message": "Abort before decoding finished."}
                else:
                    continue
                ended.append(j)
            alive[ended] = False
            n_alive = int(alive.sum())
            if n_alive == 0:
                return
            if n_alive <= _COMPACT_BELOW * len(rows):
                keep = alive.nonzero()[:, 0]
                cache.reorder_cache(keep)
                rows, tok, attn, next_pos = rows[keep], tok[keep], attn[keep], next_pos[keep]
                alive = torch.ones(len(rows), dtype=torch.bool)
            attn = torch.cat([attn, torch.ones(len(rows), 1, dtype=attn.dtype)], dim=1)
            out = self.model(
                input_ids=tok[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                past_key_values=cache, use_cache=True,
            )  # fmt: skip
            next_pos = next_pos + 1

    def _match_stop(self, batch: _Batch, i: int, length: int) -> str | None:
        """Check the stop strings against the tail of the text, as SGLang does."""
        tail_ids = batch.tokens[i, max(0, length - batch.stop_window[i]) : length].tolist()
        tail = self.tokenizer.decode(tail_ids, skip_special_tokens=True)
        return next((s for s in batch.requests[i].params.stop if s in tail), None)

    def _results(self, batch: _Batch) -> list[GenResult]:
        tokens, logps = batch.tokens.tolist(), batch.logprobs.tolist()
        results = []
        for i, (r, n) in enumerate(zip(batch.requests, batch.lengths.tolist(), strict=True)):
            reason = batch.reasons[i] or {"type": "abort", "message": "Unfinished."}
            ids = tokens[i][:n]
            results.append(
                GenResult(
                    rid=r.rid,
                    output_ids=ids,
                    output_logprobs=logps[i][:n],
                    text=finish_text(self.tokenizer, ids, reason, r.params),
                    finish_reason=reason,
                    prompt_tokens=len(r.input_ids),
                    weight_version=self._version,
                )
            )
        return results
