"""Corrupted files are detected and named: batch reads, committed steps, checkpoints, replay."""

from __future__ import annotations

import logging
import os
import pickle
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from engines.train import checkpoint_io as ckpt
from engines.train.train_actor import TrainActor
from flows.replay import check_source, plan_replay
from storage.batch_io import read_samples, write_samples, write_table
from storage.integrity import CorruptFileError
from storage.object_store import ObjectStore
from storage.run_layout import RunLayout, step_dir
from storage.sample import Sample


def batch(n: int = 4, seed: int = 0) -> list[Sample]:
    return [Sample(index=seed * 100 + i, group_index=i // 2, tokens=[4, 5, 6], response_length=1,
                   loss_mask=[1], reward=float(i % 2)) for i in range(n)]


@pytest.fixture(params=["file", "memory"])
def layout(request: pytest.FixtureRequest, tmp_path: Path) -> RunLayout:
    """A run on local disk (memory-mapped reads) and on a remote-style store (whole reads)."""
    root = str(tmp_path) if request.param == "file" else f"memory://{uuid.uuid4().hex}"
    return RunLayout.open(root, "run")


def truncate(store: ObjectStore, *parts: str, keep: int = 100) -> None:
    store.write_bytes(store.read_bytes(*parts)[:keep], *parts)


def test_corrupt_file_error_names_the_file_and_pickles() -> None:
    err = pickle.loads(pickle.dumps(CorruptFileError("s3://b/run/x.arrow", "truncated")))
    assert (err.uri, err.reason, str(err)) == ("s3://b/run/x.arrow", "truncated",
                                                "s3://b/run/x.arrow: truncated")


# -- batch reads ----------------------------------------------------------------------------
def test_unparseable_batches_raise_one_error_naming_the_file(layout: RunLayout) -> None:
    store = layout.store
    store.write_bytes(b"", "a.arrow")
    write_samples(store, batch(), "b.arrow")
    truncate(store, "b.arrow")
    write_table(store, pa.table({"x": [1, 2]}), "c.arrow")
    for name, reason in [("a.arrow", "not a readable Arrow"), ("b.arrow", "not a readable Arrow"),
                         ("c.arrow", "not a sample batch")]:
        with pytest.raises(CorruptFileError, match=reason) as info:
            read_samples(store, name)
        assert info.value.uri == store.uri(name)


def test_committed_step_records_every_file_and_reads_check_them(layout: RunLayout) -> None:
    store, d = layout.store, step_dir(0)
    write_samples(store, batch(), d, "train.arrow")
    layout.save_task_record(0, "train", {"loss": 1.0})
    store.write_bytes(b"junk", d, "metrics.json.tmp-1234abcd")  # an interrupted write
    layout.mark_committed(0)
    files = store.read_json(d, "COMMITTED")["files"]
    assert sorted(files) == ["tasks/train.json", "train.arrow"]
    assert read_samples(store, d, "train.arrow") == batch()

    good = store.read_bytes(d, "train.arrow")
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF  # same size, may well still parse
    store.write_bytes(bytes(flipped), d, "train.arrow")
    with pytest.raises(CorruptFileError, match="sha256 differs"):
        read_samples(store, d, "train.arrow")
    truncate(store, d, "train.arrow")
    with pytest.raises(CorruptFileError, match=r"100 bytes, \d+ when recorded") as info:
        read_samples(store, d, "train.arrow")
    assert info.value.uri == store.uri(d, "train.arrow")
    store.delete(d, "train.arrow")
    with pytest.raises(CorruptFileError, match="missing"):
        read_samples(store, d, "train.arrow")


# -- checkpoints ----------------------------------------------------------------------------
def save_checkpoint(layout: RunLayout, k: int, tmp_path: Path, manifest: bool = True) -> None:
    """What TrainActor.save_checkpoint does with a backend's local directory."""
    local = tmp_path / f"local{k}"
    (local / "sub").mkdir(parents=True)
    (local / "model.bin").write_bytes(os.urandom(1000))
    (local / "sub" / "meta.json").write_text(f'{{"version": {k + 1}}}')
    if manifest:
        ckpt.write_manifest(str(local))
    layout.store.put_dir(str(local), *layout.checkpoint_parts(k))
    layout.set_latest_checkpoint(k)


def test_without_latest_the_newest_complete_checkpoint_is_found(
    layout: RunLayout, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for k in (0, 1, 2):
        save_checkpoint(layout, k, tmp_path)
    assert layout.latest_checkpoint() == 2 and layout.latest_checkpoint(before=2) == 1
    layout.store.delete("checkpoints", "LATEST")
    layout.store.delete(*layout.checkpoint_parts(2), "MANIFEST.json")  # a save cut short
    with caplog.at_level(logging.WARNING, logger="storage.run_layout"):
        assert layout.latest_checkpoint() == 1
    assert "no checkpoints/LATEST" in caplog.text
    assert "checkpoint 000002 is not complete" in caplog.text


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(
    layout: RunLayout, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for k in (0, 1):
        save_checkpoint(layout, k, tmp_path)
    truncate(layout.store, *layout.checkpoint_parts(1), "model.bin")
    with caplog.at_level(logging.WARNING, logger="storage.run_layout"):
        assert layout.latest_checkpoint() == 0
    assert "checkpoints/000001/model.bin: 100 bytes, 1000 when recorded" in caplog.text
    layout.store.delete(*layout.checkpoint_parts(0), "sub", "meta.json")
    assert layout.latest_checkpoint() is None


def test_latest_checkpoint_skips_newer_saves_and_trusts_legacy_ones(
    layout: RunLayout, tmp_path: Path
) -> None:
    save_checkpoint(layout, 0, tmp_path, manifest=False)  # the layout writes the manifest
    assert layout.store.exists(*layout.checkpoint_parts(0), "MANIFEST.json")
    save_checkpoint(layout, 1, tmp_path)
    layout.store.write_text("0", "checkpoints", "LATEST")  # step 1's save never finished
    assert layout.latest_checkpoint() == 0
    layout.store.delete(*layout.checkpoint_parts(0), "MANIFEST.json")  # saved before manifests
    assert layout.latest_checkpoint() == 0


def test_latest_is_never_moved_to_an_incomplete_checkpoint(
    layout: RunLayout, tmp_path: Path
) -> None:
    local = tmp_path / "local"
    local.mkdir()
    (local / "model.bin").write_bytes(b"x" * 10)
    ckpt.write_manifest(str(local))
    (local / "model.bin").unlink()  # the upload lost a file
    layout.store.put_dir(str(local), *layout.checkpoint_parts(3))
    with pytest.raises(CorruptFileError, match="model.bin: missing"):
        layout.set_latest_checkpoint(3)
    assert not layout.store.exists("checkpoints", "LATEST")


def test_a_checkpoint_altered_after_saving_is_refused_on_load(tmp_path: Path) -> None:
    (tmp_path / "optimizer.pt").write_bytes(b"state" * 10)
    ckpt.write_manifest(str(tmp_path))
    ckpt.verify_checkpoint(str(tmp_path))
    (tmp_path / "optimizer.pt").write_bytes(b"STATE" * 10)
    with pytest.raises(CorruptFileError, match="optimizer.pt: sha256 differs"):
        ckpt.verify_checkpoint(str(tmp_path))


# -- resume and replay ----------------------------------------------------------------------
def test_resume_without_latest_uses_the_newest_checkpoint_not_the_initial_model(
    make_config: Any
) -> None:
    """Step 0's batch truncated and LATEST deleted. The rebuild starts at
    checkpoint 1 and never needs step 0; a rebuild that does need it names the file."""
    cfg = make_config("resume")
    trainer = TrainActor(cfg)
    layout = trainer.layout
    for k in range(3):
        write_samples(layout.store, batch(seed=k), step_dir(k), "train.arrow")
        trainer.train_step(k)
        trainer.save_checkpoint(k)
        layout.mark_committed(k)
    truncate(layout.store, step_dir(0), "train.arrow")
    layout.store.delete("checkpoints", "LATEST")
    layout.store.delete(*layout.checkpoint_parts(2))

    restarted = TrainActor(cfg)
    assert restarted.ensure_version(3) == {"rebuilt": True, "version": 3, "replayed": [2],
                                           "unrecorded": [2], "inexact": []}
    layout.store.delete(*layout.checkpoint_parts(1))
    layout.store.delete(*layout.checkpoint_parts(0))
    with pytest.raises(CorruptFileError, match=r"steps/000000/train.arrow: 100 bytes"):
        TrainActor(cfg).ensure_version(3)


def test_replay_checks_its_source_before_copying(layout: RunLayout, tmp_path: Path) -> None:
    for k in range(3):
        write_samples(layout.store, batch(seed=k), step_dir(k), "train.arrow")
        layout.mark_committed(k)
    save_checkpoint(layout, 0, tmp_path)
    plan = plan_replay(layout, "run", 1, 3)
    assert (plan.checkpoint, plan.warmup) == (0, [])
    check_source(layout, plan)
    truncate(layout.store, step_dir(2), "train.arrow")
    with pytest.raises(CorruptFileError, match="steps/000002/train.arrow"):
        check_source(layout, plan)
    write_samples(layout.store, batch(seed=2), step_dir(2), "train.arrow")
    bad = bytearray(layout.store.read_bytes(*layout.checkpoint_parts(0), "model.bin"))
    bad[0] ^= 1
    layout.store.write_bytes(bytes(bad), *layout.checkpoint_parts(0), "model.bin")
    with pytest.raises(CorruptFileError, match="000000/model.bin: sha256 differs"):
        check_source(layout, plan)
