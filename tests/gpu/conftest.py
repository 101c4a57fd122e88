"""GPU-only tests: skipped (not failed) wherever CUDA or megatron-core is missing, so CPU CI
collects and skips them. Run on a GPU machine with `pytest tests/gpu`: each module that runs
there runs in a pytest process of its own (tests/support/own_process.py), with a clean CUDA
context, no process group or megatron state and no environment left by another module."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.support import own_process


def _runs_here(item: pytest.Item) -> bool:
    """A GPU test not skipped before it starts (no GPU or megatron-core, or `needs_two`)."""
    if "tests/gpu/" not in str(item.fspath).replace("\\", "/"):
        return False
    if item.get_closest_marker("skip"):
        return False
    return not any(m.args and m.args[0] is True for m in item.iter_markers("skipif"))


def _visible_gpus() -> list[str]:
    import torch

    count = torch.cuda.device_count()
    named = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return named[:count] if named else [str(i) for i in range(count)]


def gpus_wanted(items: list[pytest.Item]) -> int:
    """GPUs a module's tests use: the largest `gpus(n)` marker among them, else 1."""
    return max([1, *(int(m.args[0]) for i in items for m in i.iter_markers("gpus"))])


def pytest_configure(config: pytest.Config) -> None:
    """A module per process, one module per GPU at a time and at least two
    (`ROLLFLOW_GPU_MODULES_AT_ONCE` overrides): a one-GPU module sees its slot's GPU, a module
    marked `gpus(2)` sees them all; two modules may share a GPU (the tests' models are small,
    and most of a module's time is its processes' start-up). The two-GPU modules, the
    longest, start first."""
    gpus = _visible_gpus()
    at_once = int(os.environ.get("ROLLFLOW_GPU_MODULES_AT_ONCE", max(2, len(gpus))))

    def env_for(items: list[pytest.Item], slot: int) -> dict[str, str]:
        if not gpus or gpus_wanted(items) > 1:
            return {}
        return {"CUDA_VISIBLE_DEVICES": gpus[slot % len(gpus)]}

    own_process.register(config, _runs_here, at_once, env_for, gpus_wanted)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    reason = None
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU"
    elif importlib.util.find_spec("megatron") is None:
        reason = "needs megatron-core (pip install rollflow[megatron])"
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def qwen2_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A randomly initialised Qwen2-shaped model (GQA, q/k/v biases, untied head)."""
    from tests.support.gpu import save_qwen2_tiny

    return save_qwen2_tiny(str(tmp_path_factory.mktemp("qwen2-tiny")))
