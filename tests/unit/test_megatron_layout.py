"""A megatron checkpoint resumed under another parallel layout is refused before anything
loads, in one line naming both layouts and the way out (megatron's own failure was a
200-line KeyError from dist_checkpointing on every rank)."""

from __future__ import annotations

import pytest

from engines.train.megatron.checkpoint import ParallelLayoutError, check_layout
from tasks.retries import DETERMINISTIC

SAVED = {"tensor_parallel": 1, "pipeline_parallel": 1, "expert_parallel": 1, "data_parallel": 2}


def test_the_same_layout_and_old_checkpoints_load() -> None:
    check_layout("/c", dict(SAVED), dict(SAVED), 6)
    check_layout("/c", None, {**SAVED, "tensor_parallel": 2}, 6)  # saved before layouts


@pytest.mark.parametrize("change", [{"tensor_parallel": 2, "data_parallel": 1},
                                    {"data_parallel": 1}, {"expert_parallel": 2}])
def test_another_layout_is_refused_in_one_line(change: dict[str, int]) -> None:
    with pytest.raises(ParallelLayoutError) as err:
        check_layout("/tmp/stage/ckpt", SAVED, {**SAVED, **change}, 6)
    message = str(err.value)
    assert "\n" not in message
    assert "TP=1 PP=1 EP=1 DP=2" in message  # saved
    wanted = {**SAVED, **change}
    assert (f"TP={wanted['tensor_parallel']} PP=1 EP={wanted['expert_parallel']} "
            f"DP={wanted['data_parallel']}") in message
    assert "checkpoints/000005" in message and "train.model_path" in message
    assert isinstance(err.value, DETERMINISTIC)  # not retried: it fails the same every time
