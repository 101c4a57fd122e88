"""Prompt sets in object storage (moto's S3 on 127.0.0.1, through the run's fsspec store):
a JSON Lines file, a directory of parquet shards and a `save_to_disk` dataset, each drawn by
the data source; and a run that trains from an s3:// prompt set and evaluates an s3:// one."""

from __future__ import annotations

import json
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines.data.data_source import RolloutDataSourceWithBuffer
from engines.data.prompt_dataset import DatasetError, DatasetSpec, open_prompt_dataset
from flows.config.run import EvalDataset
from storage.batch_io import read_samples
from storage.object_store import open_store
from storage.run_layout import RunLayout
from tests.support.configs import arithmetic_config


def rows(start: int, n: int) -> list[dict]:
    return [{"prompt": f"{i}+7=", "label": str(i + 7)} for i in range(start, start + n)]


def jsonl(data: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in data).encode()


def parquet(data: list[dict], path) -> bytes:
    pq.write_table(pa.Table.from_pylist(data), path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def bucket(s3_server, tmp_path_factory):
    """One bucket with the three kinds of prompt sets; returns (root URI, spec maker)."""
    root = s3_server.bucket(f"prompts-{uuid.uuid4().hex[:8]}")
    store = open_store(root, s3_server.endpoint_url, **s3_server.storage_options)
    tmp = tmp_path_factory.mktemp("s3-prompts")
    store.write_bytes(jsonl(rows(0, 12)), "train.jsonl")
    store.write_bytes(parquet(rows(100, 3), tmp / "b.parquet"), "shards", "part-001.parquet")
    store.write_bytes(parquet(rows(103, 2), tmp / "a.parquet"), "shards", "part-000.parquet")
    store.write_bytes(b"", "shards", "_SUCCESS")
    store.write_bytes(jsonl([*rows(200, 2), {"prompt": ""}]), "bad", "d.jsonl")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows(300, 5)).save_to_disk(str(tmp / "hf"), num_shards=2)
    store.put_dir(str(tmp / "hf"), "hf")

    def spec(path: str, **kw) -> DatasetSpec:
        return DatasetSpec(f"{root}/{path}", endpoint_url=s3_server.endpoint_url,
                           storage_options=s3_server.storage_options, **kw)

    return root, spec


def draw_epoch(spec: DatasetSpec, n: int) -> list[str]:
    source = RolloutDataSourceWithBuffer(open_prompt_dataset(spec, None), 2, shuffle=False)
    groups = source.get_samples(n)
    assert all(len(g) == 2 for g in groups)
    return [g[0].prompt for g in groups]


def test_prompt_sets_are_drawn_from_s3(bucket):
    root, spec = bucket
    assert draw_epoch(spec("train.jsonl"), 12) == [f"{i}+7=" for i in range(12)]
    # shards in name order (part-000 was uploaded last); the _SUCCESS marker is not data
    assert draw_epoch(spec("shards"), 5) == [f"{i}+7=" for i in (103, 104, 100, 101, 102)]
    assert draw_epoch(spec("hf"), 5) == [f"{i}+7=" for i in range(300, 305)]
    shuffled = RolloutDataSourceWithBuffer(open_prompt_dataset(spec("train.jsonl"), None), 1,
                                           seed=4)
    assert sorted(g[0].label for g in shuffled.get_samples(12)) == sorted(
        str(i + 7) for i in range(12))


def test_a_bad_row_on_s3_names_its_uri_and_line(bucket):
    root, spec = bucket
    source = RolloutDataSourceWithBuffer(open_prompt_dataset(spec("bad"), None), 1,
                                         shuffle=False)
    assert [g[0].prompt for g in source.get_samples(2)] == ["200+7=", "201+7="]
    with pytest.raises(DatasetError) as err:
        source.get_samples(1)
    assert str(err.value) == f"{root}/bad/d.jsonl, line 3, field 'prompt': empty prompt"
    with pytest.raises(DatasetError, match="No such file or directory"):
        open_prompt_dataset(spec("nothing.jsonl"), None)


def test_a_run_trains_from_s3_prompts_and_evaluates_an_s3_set(
    bucket, s3_server, prefect_api, ray_address, arithmetic_data, tiny_model_dir
):
    from flows.train import train

    root, _ = bucket
    run = f"s3-prompts-{uuid.uuid4().hex[:6]}"
    cfg = arithmetic_config(
        run_name=run, runs_root=f"{root}/runs", data=arithmetic_data, model_dir=tiny_model_dir,
        ray_address=ray_address,
        overrides=[f"data.prompt_data={root}/train.jsonl", "rollout.num_rollout=2"],
    )
    cfg.eval.datasets = [EvalDataset(name="held", path=f"{root}/shards", label_key="label")]
    cfg.storage.endpoint_url = s3_server.endpoint_url
    cfg.storage.storage_options = dict(s3_server.storage_options)
    result = train(cfg)
    assert result["prompts"] == 12
    layout = RunLayout(open_store(f"{root}/runs", s3_server.endpoint_url,
                                  **s3_server.storage_options).child(run))
    assert layout.committed_steps() == [0, 1]
    drawn = {s.prompt for k in (0, 1)
             for s in read_samples(layout.store, f"steps/{k:06d}", "prompts.arrow")}
    assert drawn <= {f"{i}+7=" for i in range(12)} and len(drawn) == 8  # 4 groups a step
    evals = layout.evals()
    assert list(evals) == [2] and evals[2]["eval/held/samples"] == 5.0
