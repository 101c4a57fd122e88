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
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("qwen2-tiny"))
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path
