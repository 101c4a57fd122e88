"""A train group loads a checkpoint from S3 (moto) once per disk, not once per rank
(`engines/train/checkpoint_staging.fetch_and_load`): two gloo ranks sharing a disk read one
download; on two disks (two working directories behind one relative path) each disk
downloads its own copy. Every rank sees every file either way."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from engines.train.checkpoint_staging import fetch_and_load
from storage.object_store import open_store
from tests.support.fakes import CountingStore
from tests.support.rendezvous import file_rendezvous

PARTS = ("checkpoints", "000003")
FILES = {"meta.json": "{}", "dist_ckpt/__0_0.distcp": "shard 0", "dist_ckpt/__1_0.distcp": "shard 1"}


def _rank(rank: int, init: str, uri: str, options: dict[str, Any], workdirs: list[str],
          out: str) -> None:
    os.chdir(workdirs[rank])
    dist.init_process_group("gloo", init_method=init, rank=rank,
                            world_size=2)
    try:
        store = CountingStore(uri, options)
        store.out = out
        seen: dict[str, Any] = {}

        def load(path: str) -> None:
            seen["path"] = os.path.abspath(path)
            seen["files"] = sorted(str(p.relative_to(path)) for p in Path(path).rglob("*")
                                   if p.is_file())

        root = "."  # the rank's working directory: one per simulated disk
        fetch_and_load(load, store, PARTS, root)
        dist.barrier()  # every rank has returned (the disk's uploader removes the copy)
        seen["left"] = os.path.exists(seen["path"])
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(seen, f)
    finally:
        dist.destroy_process_group()


def _run(s3_server: Any, tmp_path: Path, bucket: str, disks: int) -> tuple[list[dict], list[str]]:
    uri = s3_server.bucket(bucket)
    store = open_store(uri, s3_server.endpoint_url, **s3_server.storage_options)
    for name, text in FILES.items():
        store.write_text(text, *PARTS, name)
    out = tmp_path / "out"
    workdirs = [tmp_path / f"node{i % disks}" for i in range(2)]
    for d in (out, *workdirs):
        d.mkdir(exist_ok=True)
    mp.spawn(_rank, args=(file_rendezvous(tmp_path), uri, store.storage_options,
                          [str(w) for w in workdirs], str(out)), nprocs=2, join=True)
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return seen, sorted(p.name for p in out.glob("download-*"))


@pytest.mark.timeout(180)
def test_ranks_sharing_a_disk_download_once(s3_server, tmp_path: Path) -> None:
    seen, downloads = _run(s3_server, tmp_path, "staging-one-disk", disks=1)
    assert downloads == ["download-0"]
    assert seen[0]["path"] == seen[1]["path"]
    assert seen[0]["files"] == seen[1]["files"] == sorted(FILES)
    assert not seen[0]["left"] and not seen[1]["left"]  # the copy is removed after loading


@pytest.mark.timeout(180)
def test_ranks_on_two_disks_download_a_copy_each(s3_server, tmp_path: Path) -> None:
    seen, downloads = _run(s3_server, tmp_path, "staging-two-disks", disks=2)
    assert downloads == ["download-0", "download-1"]
    assert seen[0]["path"] != seen[1]["path"]
    assert seen[0]["files"] == seen[1]["files"] == sorted(FILES)
