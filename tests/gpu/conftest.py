"""GPU-only tests: skipped (not failed) wherever CUDA or megatron-core is missing, so CPU CI
collects and skips them. Run on a GPU machine with `pytest -m gpu tests/gpu`."""

from __future__ import annotations

import importlib.util

import pytest


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
