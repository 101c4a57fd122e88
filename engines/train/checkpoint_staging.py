"""Where a train group's ranks stage a checkpoint on local disk before it goes to storage.

A collective save (megatron's `dist_checkpointing`) has every rank write its own shard files
into one directory, and it needs that directory to be the same path on every rank. Were each
rank to stage in a temporary directory of its own with only rank 0's uploaded, the other
ranks' shards would be deleted with theirs and a TP/PP/DP > 1 checkpoint could not be
loaded. So:

* rank 0 names one staging path and every rank saves into it;
* the ranks find which of them share a disk by the files they can see (a marker per rank),
  so ranks on one node (or on a shared file system) upload once, through their lowest rank,
  and each node's files reach storage (no two nodes wrote the same file);
* the manifest covers the files of every node and is uploaded last, once every node's files
  are in, so a stored copy counts as complete only then (`storage/run_layout.py` scans by
  manifest), whenever a rank is killed;
* loading from an object store downloads a checkpoint once per disk, not once per rank;
* a step that fails on some ranks only (a full disk, an upload error) fails on every rank,
  at the same point (`_agreed`): a rank that raised alone would leave the others in the
  next barrier forever, or pair that barrier with a later one, so they would move LATEST
  over a checkpoint some of whose files were never stored.

Without a process group (one rank), it is a plain temporary directory.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from storage import integrity
from storage.object_store import ObjectStore

_MARKER = ".rollflow-rank-"
T = TypeVar("T")


class GroupCheckpointError(RuntimeError):
    """A step of a group's checkpoint save or load failed on some rank; raised on every rank."""


@dataclass(frozen=True, slots=True)
class StagingDir:
    """`path` is the same on every rank; `uploads` is true on one rank per disk."""

    path: str
    uploads: bool


def _dist() -> Any | None:
    """torch.distributed when this process is one of several ranks of a group. A process that
    never imported torch is in none: the mock trainer, which then never pays its import."""
    if "torch" not in sys.modules:
        return None
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _agreed(what: str, step: Callable[[], T]) -> T:
    """`step()` on this rank; in a group, then every rank learns whether any rank failed, and
    if one did, all raise (naming the failed ranks and their errors) at this same point."""
    dist = _dist()
    if dist is None:
        return step()
    error: Exception | None = None
    try:
        result = step()
    except Exception as exc:  # reported to every rank below, then raised
        error = exc
    errors: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}")
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise GroupCheckpointError(f"{what} failed on {'; '.join(failed)}") from error
    return result


def _mkdtemp(root: str) -> str:
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix="rollflow-ckpt-", dir=root)


def _shared_name(dist: Any, root: str) -> str:
    mine = _agreed(f"making a staging dir under {root}",
                   lambda: _mkdtemp(root) if dist.get_rank() == 0 else "")
    name = [mine]
    dist.broadcast_object_list(name, src=0)
    return str(name[0])


def _write_marker(path: str, rank: int) -> str:
    os.makedirs(path, exist_ok=True)
    marker = os.path.join(path, f"{_MARKER}{rank}")
    with open(marker, "w"):
        pass
    return marker


def _uploads(dist: Any, path: str) -> bool:
    """True on the lowest rank among those that see this rank's marker file (its disk)."""
    rank = dist.get_rank()
    marker = _agreed(f"writing into the staging dir {path}", lambda: _write_marker(path, rank))
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
        if root:
            os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="rollflow-ckpt-", dir=root) as tmp:
            yield StagingDir(tmp, uploads=True)
        return
    path = _shared_name(dist, root or tempfile.gettempdir())
    try:
        staged = StagingDir(path, uploads=_uploads(dist, path))
    except GroupCheckpointError:
        shutil.rmtree(path, ignore_errors=True)  # the empty dir some rank could not write to
        raise
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

    def own_manifest() -> integrity.Manifest | None:
        mine = integrity.read_manifest(store) if dist.get_rank() == 0 else None
        if mine is None and staged.uploads:
            mine = integrity.dir_manifest(store, skip=(integrity.MANIFEST_FILE,))
        return mine

    mine = _agreed("digesting the staged checkpoint", own_manifest)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)

    def write_merged() -> None:
        if dist.get_rank() == 0:
            merged: integrity.Manifest = {}
            for manifest in every:
                merged.update(manifest or {})
            integrity.write_manifest(store, merged)

    _agreed("writing the merged manifest", write_merged)


def save_and_store(
    save: Callable[[str], None], store: ObjectStore, parts: tuple[str, ...],
    root: str | None = None, prepare: Callable[[], bool] | None = None,
) -> str:
    """`save(path)` on every rank (collective for a sharded backend), then every disk's files
    under `parts` of `store`, the manifest last (the commit: a reader counts the checkpoint
    only once it is there); returns the stored URI where this rank uploaded, else ''. All
    of it is stored when it returns, on any rank (a group's ranks wait for each other).

    `prepare()`, on rank 0 before anything is written, readies `parts` for the save and says
    whether the checkpoint is already stored whole; then nothing is saved (on any rank)."""
    dist = _dist()
    first = dist is None or dist.get_rank() == 0
    stored = _agreed(f"preparing {store.uri(*parts)}",
                     lambda: bool(prepare()) if prepare is not None and first else False)
    if dist is not None:
        decided = [stored]
        dist.broadcast_object_list(decided, src=0)
        stored = bool(decided[0])
    if stored:
        return store.uri(*parts) if first else ""
    with staging_dir(root) as staged:
        _agreed("saving the checkpoint", lambda: save(staged.path))
        merge_manifests(staged)
        manifest = _agreed("setting the manifest aside",
                           lambda: _take_manifest(staged) if staged.uploads else None)
        # every disk's files are stored before any rank returns (or all raise)
        uri = _agreed(f"storing the checkpoint at {store.uri(*parts)}",
                      lambda: store.put_dir(staged.path, *parts, move=True) if staged.uploads else "")
        _agreed(f"committing the checkpoint at {store.uri(*parts)}",
                lambda: None if manifest is None else
                store.write_bytes(manifest, *parts, integrity.MANIFEST_FILE))
        return uri


def _take_manifest(staged: StagingDir) -> bytes | None:
    """The staged manifest's bytes, its file removed so that `put_dir` does not upload it
    among the others, in whatever order it walks them."""
    path = os.path.join(staged.path, integrity.MANIFEST_FILE)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    os.remove(path)
    return data


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
        # the disk's copy is whole before any rank of it reads
        _agreed(f"downloading the checkpoint at {store.uri(*parts)}",
                lambda: store.get_dir(staged.path, *parts) if staged.uploads else None)
        _agreed("loading the checkpoint", lambda: load(staged.path))
