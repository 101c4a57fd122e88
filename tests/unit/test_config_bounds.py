"""Bad values fail at load with the dotted key, before anything starts."""

from __future__ import annotations

import pytest

from flows.config.loader import config_from_dict
from flows.config.run import ConfigError


def _cfg(**sections):
    raw = {
        "data": {"prompt_data": "/d/train.jsonl", "input_key": "question",
                 "label_key": "answer", "apply_chat_template": True},
        "rollout": {"num_rollout": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "train": {"model_path": "/m"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


@pytest.mark.parametrize("key, value", [
    ("train.save_interval", 0),
    ("train.global_batch_size", -5),
    ("eval.eval_interval", 0),
    ("rollout.over_sampling_batch_size", 0),
    ("data.rollout_max_prompt_len", 0),
    ("cluster.num_cpus", 0),
    ("rollout.top_k", -2),
])
def test_counts_and_intervals_are_bounded(key, value):
    section, field = key.split(".")
    with pytest.raises(ConfigError, match=rf"{key}: Input should be greater than or equal"):
        _cfg(**{section: {field: value}})


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "", "x" * 101, "a b", "r:1"])
def test_run_names_stay_inside_the_storage_root(name):
    with pytest.raises(ConfigError, match=r"storage.run_name: .* must be 1-100 letters"):
        _cfg(storage={"run_name": name})


@pytest.mark.parametrize("name", ["p-dot.v2", "Run_7", "0abc"])
def test_ordinary_run_names_pass(name):
    assert _cfg(storage={"run_name": name}).storage.run_name == name


def test_eval_sets_inherit_the_data_keys_unless_set():
    cfg = _cfg(eval={"datasets": [{"name": "a", "path": "/a.jsonl"},
                                  {"name": "b", "path": "/b.jsonl", "input_key": "q",
                                   "apply_chat_template": False}]})
    a, b = cfg.eval.datasets
    assert (a.input_key, a.label_key, a.apply_chat_template) == ("question", "answer", True)
    assert (b.input_key, b.label_key, b.apply_chat_template) == ("q", "answer", False)


def test_eval_set_names_are_unique():
    with pytest.raises(ConfigError, match=r"repeated: \['a'\]"):
        _cfg(eval={"datasets": [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]})


def test_list_positions_read_as_written():
    with pytest.raises(ConfigError, match=r"eval\.datasets\[1\]\.n_samples_per_eval_prompt"):
        _cfg(eval={"datasets": [{"name": "a", "path": "/a"},
                                {"name": "b", "path": "/b", "n_samples_per_eval_prompt": 0}]})
