"""A train group's checkpoint reaches storage whole (`engines/train/checkpoint_staging.py`):
two gloo ranks each write a shard file, as megatron's collective save does, into one staging
path. Sharing a disk, the ranks store it once; on two disks (two working directories behind
one relative path), each disk's files are stored and the manifest lists both shards, so the
stored copy counts as complete only with every rank's files. A step that fails on one rank
fails on both, at once, and leaves the group in step for the next save."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from engines.train.checkpoint_io import write_manifest
from engines.train.checkpoint_staging import GroupCheckpointError, save_and_store
from storage import integrity
from storage.object_store import ObjectStore
from tests.support.fakes import FullDiskStore
from tests.support.rendezvous import file_rendezvous


def _collective_save(path: str) -> None:
    """What a sharded backend does: every rank its shard, rank 0 the metadata and, once all
    are written, the manifest of the files it sees."""
    rank = dist.get_rank()
    with open(os.path.join(path, f"__{rank}_0.distcp"), "w") as f:
        f.write(f"shard of rank {rank}")
    if rank == 0:
        with open(os.path.join(path, "meta.json"), "w") as f:
            f.write("{}")
    dist.barrier()
    if rank == 0:
        write_manifest(path)


def _rank(
    rank: int, init: str, store_dir: str, workdirs: list[str], out: str, failing_rank: int
) -> None:
    os.chdir(workdirs[rank])
    dist.init_process_group("gloo", init_method=init, rank=rank,
                            world_size=2)
    try:
        root = "staging"  # under the rank's working directory: one per simulated disk
        store = (FullDiskStore if rank == failing_rank else ObjectStore)(store_dir)
        error = ""
        if failing_rank >= 0:  # the first save fails on that rank, on every rank
            try:
                save_and_store(_collective_save, store, ("checkpoints", "000000"), root)
            except GroupCheckpointError as exc:
                error = str(exc)
        uri = save_and_store(_collective_save, store, ("checkpoints", "000000"), root)
        dist.barrier()  # every rank has returned (the disk's uploader removes the staging)
        left = sorted(p.name for p in Path(root).glob("rollflow-ckpt-*"))
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"uri": uri, "left": left, "error": error}, f)
    finally:
        dist.destroy_process_group()


def _run(tmp_path: Path, disks: int, failing_rank: int = -1) -> tuple[ObjectStore, list[dict]]:
    store_dir, out = tmp_path / "store", tmp_path / "out"
    workdirs = [tmp_path / f"node{i % disks}" for i in range(2)]
    for d in (store_dir, out, *workdirs):
        d.mkdir(exist_ok=True)
    mp.spawn(_rank, args=(file_rendezvous(tmp_path), str(store_dir), [str(w) for w in workdirs], str(out),
                          failing_rank), nprocs=2, join=True)
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return ObjectStore(str(store_dir)), results


def _stored(store: ObjectStore) -> tuple[set[str], set[str]]:
    manifest = integrity.read_manifest(store, "checkpoints", "000000")
    assert manifest is not None
    problems = integrity.check_dir(store, manifest, "checkpoints", "000000", checksums=True)
    assert not problems
    return set(manifest), {p.name for p in Path(store.path("checkpoints", "000000")).iterdir()}


@pytest.mark.timeout(120)
def test_ranks_sharing_a_disk_store_every_shard_once(tmp_path: Path) -> None:
    store, results = _run(tmp_path, disks=1)
    listed, files = _stored(store)
    assert listed == {"__0_0.distcp", "__1_0.distcp", "meta.json"}
    assert files == listed | {integrity.MANIFEST_FILE}
    assert results[0]["uri"] and results[1]["uri"] == ""  # stored once, by rank 0
    assert results[0]["left"] == results[1]["left"] == []  # staging removed


@pytest.mark.timeout(120)
def test_ranks_on_two_disks_store_both_and_the_manifest_lists_both(tmp_path: Path) -> None:
    store, results = _run(tmp_path, disks=2)
    listed, files = _stored(store)
    assert listed == {"__0_0.distcp", "__1_0.distcp", "meta.json"}  # merged across disks
    assert files == listed | {integrity.MANIFEST_FILE}
    assert results[0]["uri"] and results[1]["uri"]  # each disk stored its own files
    assert results[0]["left"] == results[1]["left"] == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("disks, failing_rank", [(1, 0), (2, 1)])
def test_an_upload_failing_on_one_rank_fails_on_every_rank_and_the_next_save_works(
    tmp_path: Path, disks: int, failing_rank: int
) -> None:
    """One disk: rank 0, its only uploader, fails. Two disks: rank 1's disk fails, while rank
    0's upload succeeds (rank 0 must not return, and then move LATEST, without rank 1's
    shard stored). Both ranks raise, naming the rank and its error, instead of one waiting
    forever; the retried save stores every shard and leaves no staging behind."""
    store, results = _run(tmp_path, disks, failing_rank)
    for result in results:
        assert f"rank {failing_rank}: OSError" in result["error"]
        assert "No space left on device" in result["error"]
        assert result["left"] == []
    listed, files = _stored(store)
    assert listed == {"__0_0.distcp", "__1_0.distcp", "meta.json"}
    assert files == listed | {integrity.MANIFEST_FILE}
