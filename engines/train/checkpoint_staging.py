"""Where a train group's ranks stage a checkpoint on local disk before it goes to storage.

A collective save (megatron's `dist_checkpointing`) has every rank write its own shard files
into one directory, and it needs that directory to be the same path on every rank. Each rank
used to stage in a temporary directory of its own, and only rank 0's was uploaded: the
other ranks' shards were deleted with theirs, so a TP/PP/DP > 1 checkpoint could not be
loaded. Now:

* rank 0 names one staging path and every rank saves into it;
* the ranks find which of them share a disk by the files they can see (a marker per rank),
  so ranks on one node (or on a shared file system) upload once, through their lowest rank,
  and each node's files reach storage (no two nodes wrote the same file);
* the manifest covers the files of every node, so a stored copy counts as complete only once
  all of them are in (`storage/run_layout.py` scans by manifest);
* loading from an object store downloads a checkpoint once per disk, not once per rank.

Without a process group (one rank), it is a plain temporary directory, as before.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from storage import integrity
from storage.object_store import ObjectStore

_MARKER = ".rollflow-rank-"


@dataclass(frozen=True, slots=True)
class StagingDir:
    """`path` is the same on every rank; `uploads` is true on one rank per disk."""

    path: str
    uploads: bool


def _dist() -> Any | None:
    """torch.distributed when this process is one of several ranks of a group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _barrier() -> None:
    """Wait for every rank of the group (nothing to wait for without one)."""
    dist = _dist()
    if dist is not None:
        dist.barrier()


def _shared_name(dist: Any, root: str) -> str:
    name = [tempfile.mkdtemp(prefix="rollflow-ckpt-", dir=root) if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(name, src=0)
    return str(name[0])


def _uploads(dist: Any, path: str) -> bool:
    """True on the lowest rank among those that see this rank's marker file (its disk)."""
    rank = dist.get_rank()
    marker = os.path.join(path, f"{_MARKER}{rank}")
    with open(marker, "w"):
        pass
    dist.barrier()
    seen = sorted(int(n[len(_MARKER):]) for n in os.listdir(path) if n.startswith(_MARKER))
    dist.barrier()  # every rank has looked before any marker goes
    os.remove(marker)
    dist.barrier()
    return rank == seen[0]


@contextmanager
def staging_dir(root: str | None = None) -> Iterator[StagingDir]:
    """A directory to save a checkpoint into (collectively, in a group); removed on exit."""
    dist = _dist()
    if dist is None:
        with tempfile.TemporaryDirectory(prefix="rollflow-ckpt-", dir=root) as tmp:
            yield StagingDir(tmp, uploads=True)
        return
    path = _shared_name(dist, root or tempfile.gettempdir())
    os.makedirs(path, exist_ok=True)
    staged = StagingDir(path, uploads=_uploads(dist, path))
    try:
        yield staged
    finally:
        dist.barrier()  # no disk is cleared while a rank of it may still read
        if staged.uploads:
            shutil.rmtree(path, ignore_errors=True)


def merge_manifests(staged: StagingDir) -> None:
    """Collective in a group: on several disks, rank 0's manifest (the backend wrote that of
    rank 0's disk) becomes that of every disk's files, each uploading rank digesting its own.
    On one disk nothing is read again (digesting a large checkpoint takes minutes)."""
    dist = _dist()
    if dist is None:
        return
    uploaders: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(uploaders, staged.uploads)
    if sum(map(bool, uploaders)) < 2:
        return
    store = ObjectStore(staged.path)
    mine = None
    if dist.get_rank() == 0:
        mine = integrity.read_manifest(store)
    if mine is None and staged.uploads:
        mine = integrity.dir_manifest(store, skip=(integrity.MANIFEST_FILE,))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    disks = [m for m in every if m is not None]
    if dist.get_rank() == 0:
        merged: integrity.Manifest = {}
        for manifest in disks:
            merged.update(manifest)
        integrity.write_manifest(store, merged)


def save_and_store(
    save: Callable[[str], None], store: ObjectStore, parts: tuple[str, ...],
    root: str | None = None,
) -> str:
    """`save(path)` on every rank (collective for a sharded backend), then every disk's files
    under `parts` of `store`; returns the stored URI where this rank uploaded, else ''. All
    of it is stored when it returns, on any rank (a group's ranks wait for each other)."""
    with staging_dir(root) as staged:
        save(staged.path)
        merge_manifests(staged)
        uri = store.put_dir(staged.path, *parts) if staged.uploads else ""
        _barrier()  # every disk's files are stored before any rank returns
    return uri


def fetch_and_load(
    load: Callable[[str], None], store: ObjectStore, parts: tuple[str, ...],
    root: str | None = None,
) -> None:
    """`load(path)` on every rank with the stored checkpoint at `parts` on local disk: a local
    store's own directory, else one download per disk into a shared staging path."""
    if store.protocol == "file":
        load(store.path(*parts))
        return
    with staging_dir(root) as staged:
        if staged.uploads:
            store.get_dir(staged.path, *parts)
        _barrier()  # the disk's copy is whole before any rank of it reads
        load(staged.path)
