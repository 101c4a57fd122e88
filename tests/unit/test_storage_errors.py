"""A failing store is named in one error; the retry settings reach s3fs as botocore's."""

from __future__ import annotations

import pickle

import pytest

from storage.config import StorageConfig
from storage.object_store import ObjectStore, StorageError


def test_retry_settings_become_botocore_config_on_s3_only():
    s3 = StorageConfig(uri="s3://bucket/runs", storage_options={
        "key": "k", "config_kwargs": {"read_timeout": 5}}, retries={"max_attempts": 4,
                                                                  "mode": "adaptive"})
    options = s3.store_options()
    assert options["config_kwargs"] == {"retries": {"max_attempts": 4, "mode": "adaptive"},
                                        "connect_timeout": 5.0, "read_timeout": 5}
    assert options["key"] == "k" and s3.storage_options["config_kwargs"] == {"read_timeout": 5}
    assert StorageConfig(uri="/tmp/runs", storage_options={"a": 1}).store_options() == {"a": 1}
    with pytest.raises(ValueError):
        StorageConfig(retries={"mode": "legacy"})


def test_prompt_data_and_eval_sets_on_s3_get_the_retry_settings_too():
    """The training and held-out sets are read through their own store, on S3 even where
    the run's storage is local: they retry as the run's store does."""
    from engines.config.data import DataConfig
    from engines.config.rollout import EvalDataset
    from engines.data.prompt_dataset import data_spec
    from engines.rollout.evaluation import eval_spec

    storage = StorageConfig(uri="/tmp/runs", retries={"max_attempts": 7})
    spec = data_spec(DataConfig(prompt_data="s3://bucket/train.jsonl"), storage, None)
    assert spec.storage_options["config_kwargs"]["retries"]["max_attempts"] == 7
    held_out = eval_spec(EvalDataset(name="t", path="s3://bucket/test.jsonl"), 0, storage=storage)
    assert held_out.storage_options["config_kwargs"]["retries"]["max_attempts"] == 7
    local = data_spec(DataConfig(prompt_data="/data/train.jsonl"), storage, None)
    assert "config_kwargs" not in local.storage_options


def test_a_failing_request_names_the_file_and_the_store(tmp_path):
    store = ObjectStore(str(tmp_path / "runs"))
    with pytest.raises(StorageError) as failed, store.failures_named("write", "steps", "x"):
        raise OSError(28, "No space left on device")
    assert str(failed.value) == (f"{tmp_path}/runs/steps/x: write failed on local disk: "
                                 "OSError: [Errno 28] No space left on device")
    with pytest.raises(FileNotFoundError), store.failures_named("read", "y"):
        raise FileNotFoundError("y")  # a missing file is the caller's business
    with pytest.raises(KeyError), store.failures_named("read", "y"):
        raise KeyError("a bug, not the store")
    # crosses Ray (pickled) as itself
    again = pickle.loads(pickle.dumps(failed.value))
    assert type(again) is StorageError and str(again) == str(failed.value)


def test_the_store_is_named_by_its_endpoint():
    options = {"client_kwargs": {"endpoint_url": "http://user:pw@minio:9000"}}
    assert ObjectStore("s3://b/p", options).name == "s3 at http://user:REDACTED@minio:9000"
    assert ObjectStore("s3://b/p").name == "AWS S3"
