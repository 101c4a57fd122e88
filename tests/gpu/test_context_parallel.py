"""Context parallelism on a GPU: one 32k-token sequence of the 0.5B Qwen2 shape (24 layers,
random weights, activation checkpointing) in float32, split across two ranks, gives the
log-probs and the loss of the unsplit forward within 1e-5, with less memory on each rank.

With two GPUs the ranks use one each (NCCL); with one they share it through gloo, so the
attention kernels (memory-efficient attention with a bottom-right causal mask) and each
rank's memory are the real ones and only the transport differs. The CPU version on a tiny
model, with the trainer's steps: tests/integration/test_context_parallel.py. Memory and time
at longer lengths: bench/context_parallel.py."""

from __future__ import annotations

import pytest

from bench import context_parallel as cp

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]  # a rank a GPU where there are two


def test_a_32k_sequence_split_in_two_equals_the_unsplit_one() -> None:
    args = cp.parse(["--lengths", "32768", "--dtype", "float32", "--world", "2"])
    rows = cp.run(args)
    single = rows[0][0]["single"]
    assert not single.get("oom"), "the unsplit 32k step ran out of memory"
    for rank_rows in rows:
        split = rank_rows[0]["split"]
        assert not split.get("oom"), "a split 32k step ran out of memory"
        diff = float((split["log_probs"] - single["log_probs"]).abs().max())
        assert diff <= 1e-5, f"log-probs differ by {diff}"
        assert abs(split["loss"] - single["loss"]) <= 1e-5
        assert split["peak_gib"] < single["peak_gib"], (split["peak_gib"], single["peak_gib"])
    cp.report(rows, args.world, args)
