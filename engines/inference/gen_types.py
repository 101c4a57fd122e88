"""The records and protocol every in-process engine shares: requests, results, `Generator`.

The HTTP scheduler owns a `RunningBatch` and drives it one decode step at a time, so new
requests join between steps (continuous batching) and aborts, pauses and weight updates land
between steps too. `run_to_completion` is the same loop for direct (in-process) callers.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch

ShouldAbort = Callable[[str], bool]
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


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
    """`return_routed_experts`: SGLang's flag of the same name (MoE models: the experts each
    token was routed to, in the result)."""

    rid: str
    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    return_routed_experts: bool = False


@dataclass(frozen=True, slots=True)
class GenResult:
    """One finished (or aborted) request; `finish_reason` has SGLang's shape.
    `routed_experts`: int16 `[prompt + output - 1, layers, topk]` flattened, when asked for
    and the model is an MoE model (`routed_experts.py`)."""

    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: dict[str, Any]
    prompt_tokens: int
    weight_version: int
    routed_experts: np.ndarray | None = None
    version_spans: list[tuple[int, int]] | None = None
    """`(first output index, weight version)` for each run of tokens one version generated,
    where a weight update landed mid-request; None: every token is `weight_version`'s.
    Answered as SGLang's `meta_info.weight_versions` (`sglang_protocol`)."""


class RunningBatch(Protocol):
    """The requests an engine holds: `len` counts all, `num_running` those with a KV cache."""

    def __len__(self) -> int: ...

    @property
    def num_running(self) -> int: ...


class Generator(Protocol):
    """What the HTTP server and the engine actor need from a backend. Thread-safe."""

    @property
    def weight_version(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def model_info(self) -> dict[str, Any]: ...

    def new_batch(self) -> RunningBatch: ...

    def step(self, batch: Any, admit: Sequence[GenRequest]) -> list[GenResult]:
        """Admit requests, decode one token for every running one; return those finished."""
        ...

    def abort(self, batch: Any, rids: Collection[str] | None) -> list[GenResult]:
        """End the given requests (None: all) now, with their partial output."""
        ...

    def retract(self, batch: Any) -> None:
        """Drop the KV cache; the requests re-prefill prompt + partial output on resume."""
        ...

    def generate(
        self, requests: list[GenRequest], should_abort: ShouldAbort = ...
    ) -> list[GenResult]: ...

    def load_weights(self, named: Sequence[tuple[str, torch.Tensor]], version: int | None) -> None:
        """Copy some or all named tensors in place (between decode steps)."""
        ...

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...

    def update_weights_from_disk(self, model_path: str, version: int | None) -> None: ...

    def set_weight_version(self, version: int) -> None: ...

    def release_memory(self, tags: Collection[str]) -> None: ...

    def resume_memory(self, tags: Collection[str]) -> None: ...

    def weights_checksum(self) -> str: ...


class GeneratorIdentity:
    """What every generator reports about itself (shared by the embedded and mock ones).
    Subclasses set `model_path`, `tokenizer_path`, `tokenizer` and `_version`."""

    model_path: str
    tokenizer_path: str | None
    tokenizer: Any
    _version: int

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


def never_abort(rid: str) -> bool:
    return False


def aborted_result(request: GenRequest, weight_version: int) -> GenResult:
    """What an aborted request that never reached the model returns (as in SGLang)."""
    reason = {"type": "abort", "message": "Abort before prefill."}
    return GenResult(request.rid, [], [], "", reason, len(request.input_ids), weight_version)


def run_to_completion(
    generator: Generator, requests: list[GenRequest], should_abort: ShouldAbort
) -> list[GenResult]:
    """Step one batch until every request finished; results in request order."""
    batch = generator.new_batch()
    done = {r.rid: r for r in generator.step(batch, requests)}
    live = [r.rid for r in requests if r.rid not in done]
    while live:
        aborted = [rid for rid in live if should_abort(rid)]
        if aborted:
            done.update((r.rid, r) for r in generator.abort(batch, aborted))
        done.update((r.rid, r) for r in generator.step(batch, []))
        live = [rid for rid in live if rid not in done]
    return [done[r.rid] for r in requests]


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
