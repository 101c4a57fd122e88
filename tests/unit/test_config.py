"""YAML + --set overrides, and errors that name the key."""

from __future__ import annotations

import pytest

from flows.config import ConfigError
from flows.config_loader import load_config

BASE = """
data: {prompt_data: p.jsonl}
rollout: {num_rollout: 2, rollout_batch_size: 4}
engine: {backend: mock}
train: {backend: mock}
"""


def write(tmp_path, text=BASE):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_overrides_are_typed(tmp_path):
    cfg = load_config(write(tmp_path), ["rollout.n_samples_per_prompt=8", "train.lr=1e-4",
                                        'rollout.stop=["\\n", "."]', "logging.plot=false"])
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.rollout.stop == ["\n", "."]
    assert cfg.logging.plot is False


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.n_samples_per_promt"):
        load_config(write(tmp_path), ["rollout.n_samples_per_promt=8"])


def test_bad_value_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.rollout_batch_size"):
        load_config(write(tmp_path), ["rollout.rollout_batch_size=zero"])


def test_missing_required_section_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout"):
        load_config(write(tmp_path, "data: {prompt_data: p.jsonl}\n"))


def test_cross_section_requirements(tmp_path):
    with pytest.raises(ConfigError, match="model_path"):
        load_config(write(tmp_path), ["train.backend=torch"])
