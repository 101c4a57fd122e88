"""A checkpoint save commits by its manifest, stored last, and never rewrites a complete
checkpoint (`RunLayout.prepare_checkpoint`, `checkpoint_staging.save_and_store`); the kill
test (`tests/integration/test_checkpoint_kill.py`) kills saves at random moments, these
name each case."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from engines.train import checkpoint_io as ckpt
from engines.train.checkpoint_staging import save_and_store
from storage.integrity import MANIFEST_FILE
from storage.object_store import ObjectStore
from storage.run_layout import RunLayout


@pytest.fixture(params=["file", "memory"])
def layout(request: pytest.FixtureRequest, tmp_path: Path) -> RunLayout:
    root = str(tmp_path) if request.param == "file" else f"memory://{uuid.uuid4().hex}"
    return RunLayout.open(root, "run")


def backend_save(path: str) -> None:
    """A backend's save: a few files, its manifest written last on local disk."""
    os.makedirs(os.path.join(path, "adapter"), exist_ok=True)
    for name in ("model.safetensors", "optimizer.pt", "adapter/adapter_model.safetensors"):
        with open(os.path.join(path, name), "wb") as f:
            f.write(os.urandom(2000))
    ckpt.write_manifest(path)


def save(layout: RunLayout, k: int) -> None:
    save_and_store(backend_save, layout.store, layout.checkpoint_parts(k),
                   prepare=lambda: layout.prepare_checkpoint(k))
    layout.set_latest_checkpoint(k)


def test_the_manifest_is_stored_after_every_other_file(layout: RunLayout) -> None:
    written: list[str] = []

    class Recording(ObjectStore):
        def write_bytes(self, data: bytes, *parts: str, sync: bool = True) -> str:
            written.append(parts[-1])
            return super().write_bytes(data, *parts, sync=sync)

        def put_file(self, local_path: str, *parts: str, move: bool = False) -> str:
            written.append(parts[-1])
            return super().put_file(local_path, *parts, move=move)

    store = Recording(layout.store.root, layout.store.storage_options)
    save_and_store(backend_save, store, ("checkpoints", "000000"))
    assert written[-1] == MANIFEST_FILE and written.count(MANIFEST_FILE) == 1
    assert len(written) == 4


def test_a_complete_checkpoint_is_kept_not_rewritten(layout: RunLayout) -> None:
    save(layout, 0)
    before = layout.store.read_bytes("checkpoints", "000000", "model.safetensors")
    save(layout, 0)  # a rerun's commit: other bytes would be written
    assert layout.store.read_bytes("checkpoints", "000000", "model.safetensors") == before
    assert layout.latest_checkpoint() == 0


def test_an_unfinished_save_is_cleared_before_saving_again(layout: RunLayout) -> None:
    save(layout, 0)
    leftover = ("checkpoints", "000001", "stale-shard.bin")
    layout.store.write_bytes(b"from a killed save", *leftover)
    assert layout.latest_checkpoint() == 0
    save(layout, 1)
    assert not layout.store.exists(*leftover)
    assert layout.latest_checkpoint() == 1 and not layout.checkpoint_problems(1, checksums=True)


@pytest.mark.parametrize("older", [True, False])
def test_a_corrupt_latest_checkpoint_is_unpointed_before_it_is_rewritten(
    layout: RunLayout, older: bool
) -> None:
    if older:
        save(layout, 0)
    save(layout, 1)
    parts = ("checkpoints", "000001", "optimizer.pt")
    layout.store.write_bytes(os.urandom(2000), *parts)  # same size, other bytes
    assert not layout.prepare_checkpoint(1)
    # while it is rewritten, readers see the one before it (or none), never the corrupt one
    assert not layout.store.exists("checkpoints", "000001")
    assert layout.latest_checkpoint() == (0 if older else None)
    save(layout, 1)
    assert layout.latest_checkpoint() == 1 and not layout.checkpoint_problems(1, checksums=True)
