"""When the response head's token statistics are fused by torch.compile: only on CUDA and for
a large vocabulary, where one read of the logits pays for the compile (which cost a tiny
model's first GPU train step seconds; engines/train/token_stats.py)."""

from __future__ import annotations

import pytest

from engines.train.token_stats import COMPILE_MIN_VOCAB, compiles


def test_a_large_vocabulary_on_cuda_is_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLFLOW_COMPILE_TOKEN_STATS", raising=False)
    assert compiles(is_cuda=True, rows=4, vocab=151_936)
    assert compiles(is_cuda=True, rows=1, vocab=COMPILE_MIN_VOCAB)


def test_a_small_vocabulary_the_cpu_and_empty_rows_run_eager(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLFLOW_COMPILE_TOKEN_STATS", raising=False)
    assert not compiles(is_cuda=True, rows=4, vocab=80)  # the example's character vocabulary
    assert not compiles(is_cuda=True, rows=4, vocab=COMPILE_MIN_VOCAB - 1)
    assert not compiles(is_cuda=False, rows=4, vocab=151_936)
    assert not compiles(is_cuda=True, rows=0, vocab=151_936)


def test_a_compiler_failure_turns_compiling_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLFLOW_COMPILE_TOKEN_STATS", "0")
    assert not compiles(is_cuda=True, rows=4, vocab=151_936)
