"""`compare_runs`, what the fault matrix's "samples identical" column is computed from,
reports each kind of difference between two runs, and calls nothing compared identical."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from storage.batch_io import write_samples
from storage.run_layout import RunLayout
from storage.sample import Sample
from tests.support.compare import compare_runs


def config(root: Path, name: str) -> Any:
    return SimpleNamespace(storage=SimpleNamespace(
        uri=str(root), run_name=name, endpoint_url=None, storage_options={}))


def batch(k: int) -> list[Sample]:
    return [Sample(index=k * 4 + i, group_index=k * 2 + i // 2, tokens=[4, 5, 6 + i, 7],
                   response_length=2, loss_mask=[1, 1], reward=0.25 * i) for i in range(4)]


def write_run(root: Path, name: str, steps: dict[int, list[Sample]],
              weights: torch.Tensor | None = None) -> Any:
    cfg = config(root, name)
    layout = RunLayout.open(str(root), name)
    for k, samples in steps.items():
        write_samples(layout.store, samples, f"steps/{k:06d}", "train.arrow")
        layout.mark_committed(k)
    if weights is not None:
        last = max(steps)
        os.makedirs(os.path.join(layout.uri, "checkpoints", f"{last:06d}"), exist_ok=True)
        save_file({"w": weights}, os.path.join(layout.uri, "checkpoints", f"{last:06d}",
                                               "model.safetensors"))
    return cfg


def test_the_same_samples_are_identical(tmp_path: Path) -> None:
    a = write_run(tmp_path, "a", {0: batch(0), 1: batch(1)}, torch.ones(3))
    b = write_run(tmp_path, "b", {0: batch(0), 1: batch(1)}, torch.ones(3))
    same = compare_runs(a, b, weights=("model.safetensors",))
    assert same.identical and same.samples == 8 and same.weights == 1, same


@pytest.mark.parametrize("change", [
    {"reward": 0.9}, {"tokens": [4, 5, 9, 7]}, {"loss_mask": [0, 1]}, {"index": 99},
    {"tokens": [4, 6, 8, 7]},  # a prompt token
])
def test_each_field_that_differs_is_reported(tmp_path: Path, change: dict[str, Any]) -> None:
    a = write_run(tmp_path, "a", {0: batch(0), 1: batch(1)})
    changed = batch(1)
    changed[2] = replace(changed[2], **change)
    b = write_run(tmp_path, "b", {0: batch(0), 1: changed})
    same = compare_runs(a, b)
    assert not same.identical and len(same.differences) == 1, same
    assert "step 1 sample #2" in str(same)


def test_missing_steps_samples_and_weights_are_differences(tmp_path: Path) -> None:
    a = write_run(tmp_path, "a", {0: batch(0), 1: batch(1)}, torch.ones(3))
    assert not compare_runs(a, write_run(tmp_path, "b", {0: batch(0)})).identical
    assert not compare_runs(a, write_run(tmp_path, "c", {0: batch(0), 1: batch(1)[:3]})).identical
    d = write_run(tmp_path, "d", {0: batch(0), 1: batch(1)}, torch.ones(3) + 1e-7)
    assert compare_runs(a, d, weights=("model.safetensors",), atol=1e-6).identical
    assert not compare_runs(a, d, weights=("model.safetensors",)).identical  # bit for bit


def test_nothing_compared_is_not_identical(tmp_path: Path) -> None:
    empty_a, empty_b = write_run(tmp_path, "a", {}), write_run(tmp_path, "b", {})
    same = compare_runs(empty_a, empty_b)
    assert not same.identical and "nothing compared" in str(same)
