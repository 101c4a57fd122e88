"""Sizes and SHA-256 digests of stored files, so a truncated or altered file is named where
it is read instead of failing later as an opaque parse error -- or not failing at all.

Two kinds of directory carry a manifest, `{relative path: {size, sha256}}`, of their files:

    steps/{k}/COMMITTED          the step's marker, written last, lists every file of the step
    checkpoints/{k}/MANIFEST.json written by checkpoint saving; the checkpoint is complete iff
                                  every file it lists is there with the recorded size

Writes are atomic (temp + rename, one PUT on S3), so a file that disagrees with its manifest
was changed after it was recorded: a disk fault, a careless copy, a truncation.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

from storage.object_store import ObjectStore

SEAL_FILE = "COMMITTED"
"""Seals its directory: written last, it lists the digests of the files beside it."""
MANIFEST_FILE = "MANIFEST.json"
_CHUNK = 8 << 20
_HASH_THREADS = 8  # sha256 releases the GIL: a checkpoint's shards hash side by side


class CorruptFileError(Exception):
    """A stored file that is missing, truncated, altered or does not parse. The constructor
    arguments stay in `args`, so it pickles (and crosses Ray) as itself."""

    def __init__(self, uri: str, reason: str) -> None:
        super().__init__(uri, reason)
        self.uri, self.reason = uri, reason

    def __str__(self) -> str:
        return f"{self.uri}: {self.reason}"


@dataclass(frozen=True, slots=True)
class FileDigest:
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FileDigest:
        return cls(int(data["size"]), str(data["sha256"]))


Manifest = dict[str, FileDigest]


def digest_bytes(data: bytes | memoryview) -> FileDigest:
    return FileDigest(len(data), hashlib.sha256(data).hexdigest())


def _digest_stream(f: BinaryIO) -> FileDigest:
    h, size = hashlib.sha256(), 0
    while chunk := f.read(_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return FileDigest(size, h.hexdigest())


def _files(store: ObjectStore, *parts: str) -> dict[str, int]:
    """Relative path -> size of every file under `parts` (one listing)."""
    base = store.fs._strip_protocol(store.path(*parts)).rstrip("/")  # as `find` spells it
    with store.failures_named("list", *parts):
        if not store.fs.exists(base):
            return {}
        found = store.fs.find(base, detail=True)
    return {p[len(base):].lstrip("/"): int(info["size"]) for p, info in found.items()
            if info.get("type") != "directory"}


def dir_manifest(store: ObjectStore, *parts: str, skip: Collection[str] = ()) -> Manifest:
    """Digest every file under `parts` (read back once), except the names in `skip` and
    leftover temporaries of interrupted writes."""
    rels = [rel for rel in sorted(_files(store, *parts)) if rel not in skip and ".tmp-" not in rel]
    return dict(zip(rels, _digest_files(store, parts, rels), strict=True))


def _digest_files(store: ObjectStore, parts: Sequence[str], rels: list[str]) -> list[FileDigest]:
    """The digests of files `rels` under `parts`, several at a time: a checkpoint's shards
    run to GBs, and hashing them one after another leaves cores idle (bench/RESULTS.md,
    "Checkpoint store")."""
    def digest(rel: str) -> FileDigest:
        with store.failures_named("read", *parts, rel), \
                store.fs.open(store.path(*parts, rel), "rb") as f:
            return _digest_stream(f)

    threads = min(len(rels), _HASH_THREADS, os.cpu_count() or 1)
    if threads <= 1:
        return [digest(rel) for rel in rels]
    with ThreadPoolExecutor(threads, thread_name_prefix="rollflow-sha256") as pool:
        return list(pool.map(digest, rels))


def manifest_to_json(manifest: Manifest) -> dict[str, Any]:
    return {rel: d.to_json() for rel, d in sorted(manifest.items())}


def manifest_from_json(data: dict[str, Any]) -> Manifest:
    return {rel: FileDigest.from_json(d) for rel, d in data.items()}


def write_manifest(store: ObjectStore, manifest: Manifest, *parts: str) -> str:
    return store.write_json({"files": manifest_to_json(manifest)}, *parts, MANIFEST_FILE)


def read_manifest(store: ObjectStore, *parts: str) -> Manifest | None:
    """The manifest of directory `parts`; None if it has none (or one that does not parse:
    then the directory is just as unusable)."""
    if not store.exists(*parts, MANIFEST_FILE):
        return None
    try:
        return manifest_from_json(store.read_json(*parts, MANIFEST_FILE)["files"])
    except (ValueError, KeyError, TypeError):
        return None


def check_dir(
    store: ObjectStore, manifest: Manifest, *parts: str, checksums: bool = False
) -> list[CorruptFileError]:
    """What is wrong with directory `parts` against `manifest`: missing files and sizes from
    one listing, and, with `checksums`, digests (which reads every file)."""
    sizes = _files(store, *parts)
    problems = []
    to_hash = []
    for rel, expected in sorted(manifest.items()):
        uri = store.uri(*parts, rel)
        if rel not in sizes:
            problems.append(CorruptFileError(uri, "missing (listed in its manifest)"))
        elif sizes[rel] != expected.size:
            problems.append(CorruptFileError(
                uri, f"{sizes[rel]} bytes, {expected.size} when recorded (truncated?)"))
        elif checksums:
            to_hash.append(rel)
    for rel, got in zip(to_hash, _digest_files(store, parts, to_hash), strict=True):
        if got.sha256 != manifest[rel].sha256:
            problems.append(CorruptFileError(store.uri(*parts, rel),
                                             "sha256 differs from the recorded one"))
    return problems


def verify_bytes(data: bytes | memoryview, expected: FileDigest, uri: str) -> None:
    """Raise `CorruptFileError` if `data` (a file's whole content) is not what was recorded."""
    if len(data) != expected.size:
        raise CorruptFileError(
            uri, f"{len(data)} bytes, {expected.size} when recorded (truncated?)")
    if hashlib.sha256(data).hexdigest() != expected.sha256:
        raise CorruptFileError(uri, "sha256 differs from the recorded one")


def sealed_digest(store: ObjectStore, *parts: str) -> FileDigest | None:
    """The digest recorded for file `parts` by its directory's seal, if it is sealed."""
    directory, name = parts[:-1], parts[-1]
    try:  # read, not exists() then read: one request on S3 instead of two to four
        entry = store.read_json(*directory, SEAL_FILE).get("files", {}).get(name)
    except FileNotFoundError:
        return None
    except ValueError:
        raise CorruptFileError(store.uri(*directory, SEAL_FILE), "not valid JSON") from None
    return None if entry is None else FileDigest.from_json(entry)
