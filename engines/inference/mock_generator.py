"""Deterministic fake generation with the embedded engine's interface, for flow tests.

Flow tests need an engine that answers instantly, reproducibly and without a model, but
still behaves like one at the edges the flows care about: max_new_tokens, eos, stop ids,
abort with partial output, and a weight_version that moves when weights are pushed. A fault
test that needs requests in flight for seconds gives each token a wall time
(`engine.mock_token_seconds`), slept on the scheduler's thread: the engine's HTTP server and
its health probe answer meanwhile, as a real engine's do while it decodes. Tokens
come from an RNG seeded by (sampling_seed, prompt ids, weight_version), so a new policy
version gives new samples and a replayed request gives the same ones.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import time
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

from engines.chat.tokenizer import load_tokenizer
from engines.inference.gen_types import (
    GeneratorIdentity,
    GenRequest,
    GenResult,
    ShouldAbort,
    finish_text,
    never_abort,
)

if TYPE_CHECKING:  # a mock engine holds no tensors and never imports torch (mock_backend.py)
    import torch


class _IdsTokenizer:
    """Stand-in when no tokenizer is given: text is the space-joined token ids."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)

    def encode(self, text: str) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError as err:
            raise ValueError("text input needs a tokenizer (mock engine without one)") from err


class _MockBatch:
    """Always empty: mock requests finish in the step that admits them."""

    num_running = 0

    def __len__(self) -> int:
        return 0


class MockGenerator(GeneratorIdentity):
    """Fake tokens, uniform log-probs (-log vocab_size), real stop/abort semantics."""

    def __init__(self, vocab_size: int, eos_token_id: int, tokenizer_path: str | None = None,
                 token_seconds: float = 0.0):
        self.vocab_size = vocab_size
        self.token_seconds = token_seconds
        self.eos_token_id = eos_token_id
        self.tokenizer_path = tokenizer_path
        self.tokenizer: Any = (
            load_tokenizer(tokenizer_path) if tokenizer_path else _IdsTokenizer()
        )
        self._logprob = -math.log(vocab_size)
        self._version = 0
        self.model_path = tokenizer_path or "mock"

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._version = version

    def load_weights(self, named: Sequence[tuple[str, torch.Tensor]], version: int | None) -> None:
        self._version = self._version if version is None else version

    def set_weight_version(self, version: int) -> None:
        self._version = version

    def release_memory(self, tags: Collection[str]) -> None:
        """Nothing to free: the mock holds no weights."""

    def resume_memory(self, tags: Collection[str]) -> None:
        """Nothing to restore."""

    def weights_checksum(self) -> str:
        from engines.weights.sync import weights_checksum

        return weights_checksum([])

    def new_batch(self) -> _MockBatch:
        return _MockBatch()

    def step(self, batch: _MockBatch, admit: Sequence[GenRequest]) -> list[GenResult]:
        """Every request finishes in the step that admits it: a mock has no decode loop."""
        return [self._one(r, never_abort) for r in admit]

    def abort(self, batch: _MockBatch, rids: Collection[str] | None) -> list[GenResult]:
        return []

    def retract(self, batch: _MockBatch) -> None:
        """Nothing is ever running between steps."""

    def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        if not os.path.exists(model_path):
            raise FileNotFoundError(f"model_path {model_path!r} does not exist")
        self.model_path = model_path
        self._version = self._version if version is None else version

    def generate(
        self, requests: list[GenRequest], should_abort: ShouldAbort = never_abort
    ) -> list[GenResult]:
        return [self._one(r, should_abort) for r in requests]

    def _rng(self, request: GenRequest) -> random.Random:
        key = f"{request.params.sampling_seed}|{request.input_ids}|{self._version}"
        return random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))

    def _one(self, request: GenRequest, should_abort: ShouldAbort) -> GenResult:
        p = request.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else {self.eos_token_id})
        rng = self._rng(request)
        ids: list[int] = []
        reason: dict[str, Any] = {"type": "length", "length": 0}
        while len(ids) < p.max_new_tokens:
            if ids and should_abort(request.rid):
                reason = {"type": "abort", "message": "Abort before decoding finished."}
                break
            if self.token_seconds:
                time.sleep(self.token_seconds)
            ids.append(rng.randrange(self.vocab_size))
            if len(ids) >= p.max_new_tokens:
                reason = {"type": "length", "length": len(ids)}
            elif ids[-1] in stops:
                reason = {"type": "stop", "matched": ids[-1]}
                break
            elif p.stop and (hit := self._stop_str(ids, p.stop)):
                reason = {"type": "stop", "matched": hit}
                break
        return GenResult(
            rid=request.rid,
            output_ids=ids,
            output_logprobs=[self._logprob] * len(ids),
            text=finish_text(self.tokenizer, ids, reason, p),
            finish_reason=reason,
            prompt_tokens=len(request.input_ids),
            weight_version=self._version,
        )

    def _stop_str(self, ids: list[int], stop: tuple[str, ...]) -> str | None:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return next((s for s in stop if s in text), None)
