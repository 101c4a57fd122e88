"""One small file API over fsspec, for local paths and s3:// alike.

Every write is atomic: bytes go to a temporary name beside the target and are then moved into
place, so a crash never leaves a half-written file under the final name. On S3 a PUT is
already atomic per object, so the same code path simply writes the object.

A store that fails a request (S3 still answering 503 after botocore's retries,
`storage.retries`; a refused connection; a full local disk) raises `StorageError`, naming the
file and the store; a file that is not there stays `FileNotFoundError`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import fsspec

from storage.secrets import redact_url

# What a file's absence or kind raises: the caller's business, not a failing store.
_NOT_STORE_FAILURES = (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError)


class StorageError(Exception):
    """A request to the store failed for good (after the client's retries): `uri` is the
    file or directory, `store` the service (`s3 at http://...`, `local disk`). The
    constructor arguments stay in `args`, so it pickles (and crosses Ray) as itself. Not a
    deterministic failure: a task that raises it is retried."""

    def __init__(self, uri: str, store: str, action: str, reason: str) -> None:
        super().__init__(uri, store, action, reason)
        self.uri, self.store, self.action, self.reason = uri, store, action, reason

    def __str__(self) -> str:
        return f"{self.uri}: {self.action} failed on {self.store}: {self.reason}"


def is_store_failure(exc: BaseException) -> bool:
    """An error of the store itself (its service, the network, the disk), not a bug or a
    missing file: an OSError, or one of botocore's (or its HTTP stack's) own errors."""
    if isinstance(exc, _NOT_STORE_FAILURES):
        return False
    if isinstance(exc, OSError):
        return True
    return type(exc).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@dataclass
class ObjectStore:
    """Files under a root URI (`./runs`, `file:///abs`, `s3://bucket/prefix`)."""

    root: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        protocol, path = fsspec.core.split_protocol(self.root)
        self.protocol = protocol or "file"
        if self.protocol == "file":
            path = os.path.abspath(os.path.expanduser(path))
        self._root_path = path.rstrip("/")
        self.fs: fsspec.AbstractFileSystem = fsspec.filesystem(
            self.protocol, **self.storage_options
        )
        if "retries" in self.storage_options.get("config_kwargs", {}):
            # botocore retries each request as configured (`storage.retries`); s3fs would
            # repeat a whole call that still failed up to 5 times more, on top of that.
            self.fs.retries = 1

    # -- paths ---------------------------------------------------------------------------
    def path(self, *parts: str) -> str:
        """Filesystem path (no protocol) of `parts` under the root."""
        return "/".join([self._root_path, *[p.strip("/") for p in parts if p]])

    def uri(self, *parts: str) -> str:
        """Full URI, usable by anyone holding the same storage options."""
        p = self.path(*parts)
        return p if self.protocol == "file" else f"{self.protocol}://{p}"

    def child(self, *parts: str) -> ObjectStore:
        return ObjectStore(self.uri(*parts), self.storage_options)

    @property
    def name(self) -> str:
        """The service, for error messages: `s3 at <endpoint>`, `AWS S3`, `local disk`."""
        if self.protocol == "file":
            return "local disk"
        endpoint = (self.storage_options.get("endpoint_url")
                    or self.storage_options.get("client_kwargs", {}).get("endpoint_url"))
        return f"{self.protocol} at {redact_url(endpoint)}" if endpoint else "AWS S3"

    @contextmanager
    def failures_named(self, action: str, *parts: str) -> Iterator[None]:
        """Requests inside that fail for good raise `StorageError` naming `parts` and the
        store (also for callers that use `fs` directly)."""
        try:
            yield
        except Exception as exc:
            if not is_store_failure(exc):
                raise
            raise StorageError(self.uri(*parts), self.name, action, _reason(exc)) from exc

    # -- queries -------------------------------------------------------------------------
    def exists(self, *parts: str) -> bool:
        with self.failures_named("check", *parts):
            return bool(self.fs.exists(self.path(*parts)))

    def list(self, *parts: str) -> list[str]:
        """Names (not paths) directly under `parts`, sorted; empty if it does not exist."""
        p = self.path(*parts)
        with self.failures_named("list", *parts):
            if not self.fs.exists(p):
                return []
            if self.protocol != "file":
                self.fs.invalidate_cache(p)
            names = self.fs.ls(p, detail=False)
        return sorted(os.path.basename(x.rstrip("/")) for x in names)

    # -- reads ---------------------------------------------------------------------------
    def read_bytes(self, *parts: str) -> bytes:
        """The whole file; FileNotFoundError if it does not exist. One request on S3 (opening
        a file object first asks for its size: a HEAD before the GET)."""
        with self.failures_named("read", *parts):
            return bytes(self.fs.cat_file(self.path(*parts)))

    def read_json(self, *parts: str) -> Any:
        return json.loads(self.read_bytes(*parts))

    def read_text(self, *parts: str) -> str:
        return self.read_bytes(*parts).decode()

    # -- writes --------------------------------------------------------------------------
    def write_bytes(self, data: bytes, *parts: str, sync: bool = True) -> str:
        """Write atomically; returns the URI written. `sync=False` skips the fsync of a
        local file: the rename is still atomic for a crashed process, but a lost machine
        may leave the file empty or short, so only a reader that checks the content (a
        digest) may ask for it."""
        with self.failures_named("write", *parts):
            self._write(data, self.path(*parts), sync)
        return self.uri(*parts)

    def _write(self, data: bytes, target: str, sync: bool) -> None:
        if self.protocol != "file":
            with self.fs.open(target, "wb") as f:
                f.write(data)
            self.fs.invalidate_cache(os.path.dirname(target))
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                if sync:
                    os.fsync(f.fileno())
            os.replace(tmp, target)
        except OSError:  # e.g. a full disk: no temporary left behind
            if os.path.exists(tmp):
                os.remove(tmp)
            raise

    def write_json(self, obj: Any, *parts: str) -> str:
        return self.write_bytes(
            json.dumps(obj, indent=1, sort_keys=True, default=str).encode(), *parts
        )

    def write_text(self, text: str, *parts: str) -> str:
        return self.write_bytes(text.encode(), *parts)

    def put_dir(self, local_dir: str, *parts: str, move: bool = False) -> str:
        """Copy a local directory (e.g. a save_pretrained output) under `parts`, a file at a
        time and streamed (checkpoint shards run to GBs: none is read into memory), each
        written atomically as `write_bytes` does. `move=True` is for a staging directory
        that is deleted next: a local store on the same file system takes the files over by
        rename, so a checkpoint goes to disk once instead of twice."""
        for dirpath, _, files in os.walk(local_dir):
            rel = os.path.relpath(dirpath, local_dir)
            for name in files:
                sub = name if rel == "." else f"{rel}/{name}"
                self.put_file(os.path.join(dirpath, name), *parts, sub, move=move)
        return self.uri(*parts)

    def put_file(self, local_path: str, *parts: str, move: bool = False) -> str:
        """One local file under `parts`, streamed and atomic (`put_dir`'s `move`)."""
        with self.failures_named("write", *parts):
            self._put_file(local_path, self.path(*parts), move)
        return self.uri(*parts)

    def _put_file(self, source: str, target: str, move: bool) -> None:
        if self.protocol != "file":
            self.fs.put_file(source, target)  # multipart where the file is large
            self.fs.invalidate_cache(os.path.dirname(target))
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
        moved = False
        try:
            if move:
                try:
                    os.rename(source, tmp)
                    moved = True
                except OSError as exc:
                    if exc.errno != errno.EXDEV:  # only another file system is copied instead
                        raise
            if not moved:
                shutil.copyfile(source, tmp)  # in the kernel where it can (copy_file_range)
            _fsync(tmp)
            os.replace(tmp, target)
        except OSError:  # e.g. a full disk: the source stays whole, no temporary is left
            if moved:
                os.replace(tmp, source)
            elif os.path.exists(tmp):
                os.remove(tmp)
            raise

    def get_dir(self, local_dir: str, *parts: str) -> str:
        """Copy the directory at `parts` into `local_dir` (a no-op path for local stores)."""
        src = self.path(*parts)
        if self.protocol == "file":
            return src
        os.makedirs(local_dir, exist_ok=True)
        with self.failures_named("download", *parts):
            self.fs.get(src.rstrip("/") + "/", local_dir.rstrip("/") + "/", recursive=True)
        return local_dir

    def delete(self, *parts: str) -> None:
        p = self.path(*parts)
        with self.failures_named("delete", *parts):
            if self.fs.exists(p):
                self.fs.rm(p, recursive=True)


def open_store(uri: str, endpoint: str | None = None, /, **options: Any) -> ObjectStore:
    """Build a store; `endpoint` (storage.endpoint_url) points s3fs at MinIO/moto/any
    S3-compatible service, as does an `endpoint_url` among the options (s3fs's own).

    s3fs caches directory listings per process by default. Several processes (the driver and
    each actor) write to the same run directory, so a cached listing would hide their files;
    listings are therefore not cached unless `use_listings_cache` is given explicitly.
    """
    storage_options = dict(options)
    if uri.startswith("s3://"):
        storage_options.setdefault("use_listings_cache", False)
        own = storage_options.get("endpoint_url")
        if endpoint and own and own != endpoint:
            raise ValueError(f"storage.endpoint_url {endpoint} and storage_options.endpoint_url "
                             f"{own} name two endpoints: set one of them")
        if endpoint and not own:
            client_kwargs = dict(storage_options.get("client_kwargs", {}))
            client_kwargs["endpoint_url"] = endpoint
            storage_options["client_kwargs"] = client_kwargs
    return ObjectStore(uri, storage_options)


def _fsync(path: str) -> None:
    """Flush a file's data to the disk before it is renamed into place."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
