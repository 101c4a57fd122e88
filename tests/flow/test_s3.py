"""Runs on S3 (moto's server on 127.0.0.1, through s3fs): the object store, the two-step mock
flow, `rollflow runs` on an s3:// root, and resume from S3 with fresh actors."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

import pytest

from engines.cluster.actors import kill_run_actors
from engines.cluster.registry import get_run_actor
from flows.cli import main
from storage.batch_io import read_samples
from storage.object_store import open_store
from storage.run_layout import RunLayout

STEP_FILES = ["COMMITTED", "generate.progress.json", "metrics.json", "prompts.arrow",
              "rollout.arrow", "tasks", "train.arrow"]


def s3_store(s3_server, root: str):
    return open_store(root, s3_server.endpoint_url, **s3_server.storage_options)


def test_object_store_on_s3(s3_server, tmp_path):
    root = s3_server.bucket(f"store-{uuid.uuid4().hex[:8]}") + "/runs"
    store = s3_store(s3_server, root)
    assert store.list() == [] and not store.exists("a", "x.json")
    assert store.write_json({"v": 1}, "a", "x.json") == f"{root}/a/x.json"
    # A second client (as in another process) sees the file, and the first one sees what
    # the second wrote afterwards: no stale listings.
    other = open_store(root, s3_server.endpoint_url, skip_instance_cache=True,
                       **s3_server.storage_options)
    assert other.read_json("a", "x.json") == {"v": 1}
    other.write_text("y", "a", "y.txt")
    assert store.list("a") == ["x.json", "y.txt"] and store.exists("a", "y.txt")

    src = tmp_path / "ckpt"
    (src / "sub").mkdir(parents=True)
    (src / "model.bin").write_bytes(b"\x00\x01" * 1000)
    (src / "sub" / "rng.json").write_text("{}")
    store.put_dir(str(src), "checkpoints", "000001")
    assert store.list("checkpoints", "000001") == ["model.bin", "sub"]
    with tempfile.TemporaryDirectory() as tmp:
        got = store.get_dir(tmp, "checkpoints", "000001")
        assert Path(got, "model.bin").read_bytes() == b"\x00\x01" * 1000
        assert Path(got, "sub", "rng.json").read_text() == "{}"
    store.delete("a")
    assert store.list() == ["checkpoints"]


@pytest.fixture
def s3_config(prefect_api, make_config, s3_server):
    root = s3_server.bucket(f"runs-{uuid.uuid4().hex[:8]}") + "/prefix"

    def make(run_name: str, overrides: list[str]):
        cfg = make_config(run_name, *overrides, runs_root=root, unique=False)
        cfg.storage.endpoint_url = s3_server.endpoint_url
        cfg.storage.storage_options = dict(s3_server.storage_options)
        return cfg

    return make


def test_train_list_and_resume_on_s3(s3_config, s3_server, capsys):
    from flows.train import train

    run = f"s3-{uuid.uuid4().hex[:6]}"
    cfg = s3_config(run, ["train.save_interval=1", "cluster.keep_actors=true", "logging.plot=true"])
    result = train(cfg)
    assert result["run_dir"] == f"{cfg.storage.uri}/{run}" and result["resumed_at"] == 0
    layout = RunLayout(s3_store(s3_server, cfg.storage.uri).child(run))
    assert layout.committed_steps() == [0, 1]
    per_step = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    for k in (0, 1):
        assert layout.store.list(f"steps/{k:06d}") == STEP_FILES
        trained = read_samples(layout.store, f"steps/{k:06d}", "train.arrow")
        assert [s.index for s in trained] == list(range(k * per_step, (k + 1) * per_step))
    assert layout.store.list("checkpoints") == ["000000", "000001", "LATEST"]
    assert layout.latest_checkpoint() == 1
    assert layout.store.exists("curves.png") and layout.store.exists("config.yaml")
    step0 = layout.store.fs.info(layout.store.path("steps/000000/rollout.arrow"))

    capsys.readouterr()  # what train() printed
    assert main(["runs", "list", "--root", cfg.storage.uri,
                 "--endpoint-url", s3_server.endpoint_url]) == 0
    # stdout holds the CLI's lines only (Ray's "(raylet)" warnings go to stderr).
    listed = capsys.readouterr().out.splitlines()
    assert [ln.split("\t")[:3] for ln in listed] == [[run, "complete", "steps=2/2"]]
    assert main(["runs", "show", run, "--root", cfg.storage.uri,
                 "--endpoint-url", s3_server.endpoint_url]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0] == f"run {run}: complete, 2/2 steps committed"
    assert [r.split("\t")[0] for r in rows[1:]] == ["rollout_id", "0", "1"]

    # Resume from S3 alone: every actor is gone, so the data source state and the trainer's
    # weights must come back from the bucket.
    assert kill_run_actors(cfg) == 3
    longer = s3_config(run, ["rollout.num_rollout=3", "train.save_interval=1"])
    result = train(longer)
    assert result["resumed_at"] == 2
    assert result["restored"] == {"rebuilt": True, "version": 2, "replayed": [],
                                  "unrecorded": [], "inexact": []}
    assert layout.committed_steps() == [0, 1, 2]
    assert layout.store.fs.info(layout.store.path("steps/000000/rollout.arrow"))["ETag"] == step0["ETag"]
    assert layout.store.fs.info(layout.store.path("steps/000000/rollout.arrow"))["LastModified"] == step0["LastModified"]
    trained = read_samples(layout.store, "steps/000002", "train.arrow")
    assert [s.index for s in trained] == list(range(2 * per_step, 3 * per_step))
    assert layout.store.read_json("datasource", "000002.json")["sample_index"] == 3 * per_step
    assert layout.step_metrics(2)["train/weight_version"] == 3.0
    with pytest.raises(ValueError):  # released after the successful rerun
        get_run_actor(cfg.cluster.namespace, run, "trainer")


def test_replay_reads_an_s3_run_with_the_credentials_given_by_set(s3_config, s3_server,
                                                                  monkeypatch, capsys):
    """Without AWS_* in the environment, `--set storage.storage_options=...` reaches the
    command's own read of the source run (the store opens after every `--set`, or it
    fails with NoCredentialsError), then the replay flow's actors with the config; `runs list` takes
    the same `--set`."""
    from flows.train import train

    run = f"s3-replay-{uuid.uuid4().hex[:6]}"
    cfg = s3_config(run, [])
    train(cfg)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-credential lookup
    keys = "storage.storage_options={key: testing, secret: testing}"
    assert main(["replay", run, "--steps", "1:2", "--root", cfg.storage.uri,
                 "--endpoint-url", s3_server.endpoint_url, "--set", keys]) == 0
    layout = RunLayout(s3_store(s3_server, cfg.storage.uri).child(run))
    replayed = RunLayout(s3_store(s3_server, cfg.storage.uri).child(f"{run}-replay-1-2"))
    assert replayed.committed_steps() == [1]
    assert replayed.step_metrics(1)["train/loss"] == layout.step_metrics(1)["train/loss"]
    capsys.readouterr()
    assert main(["runs", "list", "--root", cfg.storage.uri,
                 "--endpoint-url", s3_server.endpoint_url, "--set", keys]) == 0
    listed = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [run, f"{run}-replay-1-2"]
