"""Local paths become absolute against the directory the command ran in; nothing else moves."""

from __future__ import annotations

import os

import pytest

from flows.config.loader import config_from_dict, load_config
from flows.config.paths import resolve_paths
from flows.config.run import ConfigError


def _raw(**sections):
    raw = {
        "data": {"prompt_data": "data/train.jsonl"},
        "rollout": {"num_rollout": 1, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
        "train": {"model_path": "Qwen/Qwen2-0.5B"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


def test_relative_paths_are_anchored_at_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict(_raw(
        storage={"uri": "./runs"},
        train={"model_path": "model", "load": "./ckpt", "checkpoint_staging_dir": "scratch"},
        eval={"datasets": [{"name": "t", "path": "../held/test.jsonl"}]},
        logging={"tensorboard_dir": "~/tb"},
    ))
    assert cfg.data.prompt_data == str(tmp_path / "data" / "train.jsonl")
    assert cfg.storage.uri == str(tmp_path / "runs")
    assert cfg.train.model_path == str(tmp_path / "model")  # exists: a local directory
    assert cfg.engine.model_path == str(tmp_path / "model")  # copied from train, resolved too
    assert cfg.train.load == str(tmp_path / "ckpt")  # explicit ./ : local even if missing
    assert cfg.train.checkpoint_staging_dir == str(tmp_path / "scratch")  # with model_path's
    assert cfg.eval.datasets[0].path == str(tmp_path.parent / "held" / "test.jsonl")
    assert cfg.logging.tensorboard_dir == os.path.expanduser("~/tb")


def test_uris_and_hub_ids_are_left_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict(_raw(storage={"uri": "s3://bucket/runs"},
                                data={"prompt_data": "s3://bucket/train.parquet"}))
    assert cfg.storage.uri == "s3://bucket/runs"
    assert cfg.data.prompt_data == "s3://bucket/train.parquet"
    assert cfg.train.model_path == "Qwen/Qwen2-0.5B"  # not on disk: a hub id


def test_resolving_twice_changes_nothing(tmp_path):
    cfg = config_from_dict(_raw(), base=tmp_path)
    assert resolve_paths(cfg, "/elsewhere") == cfg


def test_a_config_file_resolves_against_the_shell_not_the_file(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "run.yaml").write_text(
        "data: {prompt_data: data/train.jsonl}\n"
        "rollout: {num_rollout: 1, rollout_batch_size: 1, n_samples_per_prompt: 2}\n"
        "train: {model_path: m}\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config("conf/run.yaml")
    assert cfg.data.prompt_data == str(tmp_path / "data" / "train.jsonl")


def test_a_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="--config .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_a_model_name_without_a_slash_is_a_local_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = config_from_dict(_raw(train={"model_path": "modle"}))  # a typo of ./model
    assert cfg.train.model_path == str(tmp_path / "modle")  # preflight: no such directory


def test_a_path_with_slashes_that_is_not_on_disk_is_local_unless_it_reads_org_slash_name(
    tmp_path, monkeypatch
):
    """A typo in a checkpoint path must not go to the Hugging Face hub (a minute of retries
    offline, then an error about repo ids): only `org/name` whose `org` is not a local
    directory is taken as a hub id."""
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    typo = "runs/sft/checkpoint/000003"  # checkpoints/
    assert config_from_dict(_raw(train={"model_path": typo})).train.model_path == str(tmp_path / typo)
    beside = "runs/sft"  # ./runs exists: a local path
    assert config_from_dict(_raw(train={"model_path": beside})).train.model_path == str(tmp_path / beside)
    assert config_from_dict(_raw(train={"model_path": "Qwen/Qwen2-0.5B"})).train.model_path == "Qwen/Qwen2-0.5B"
