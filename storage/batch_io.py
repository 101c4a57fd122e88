"""Sample batches as Arrow IPC files (compressed), read back zero-copy where possible.

Every read that fails raises one error type, `CorruptFileError`, naming the file: a file that
does not parse as Arrow or as a sample batch, and a file of a committed step whose size or
sha256 differs from those its step's COMMITTED marker recorded (`integrity.py`).
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.ipc as ipc

from storage.arrow_schema import samples_to_table, table_to_samples
from storage.integrity import CorruptFileError, FileDigest, sealed_digest, verify_bytes
from storage.object_store import ObjectStore
from storage.sample import Sample


def table_to_ipc_bytes(table: pa.Table, compression: str | None = "zstd") -> bytes:
    sink = io.BytesIO()
    options = ipc.IpcWriteOptions(compression=compression)
    with ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue()


def write_table(
    store: ObjectStore, table: pa.Table, *parts: str, compression: str | None = "zstd"
) -> str:
    return store.write_bytes(table_to_ipc_bytes(table, compression), *parts)


def read_table(store: ObjectStore, *parts: str, expected: FileDigest | None = None) -> pa.Table:
    """Local files are memory-mapped (zero-copy for uncompressed buffers); remote ones
    are fetched once into memory. A file listed by its directory's seal (a committed step)
    is first checked against the size and sha256 recorded there, or against `expected`."""
    uri = store.uri(*parts)
    expected = expected or sealed_digest(store, *parts)
    if expected is not None and not store.exists(*parts):
        raise CorruptFileError(uri, "missing, though recorded when its step was committed")
    try:
        if store.protocol == "file":
            with pa.memory_map(store.path(*parts), "r") as source:
                data = source.read_buffer()
                if expected is not None:
                    verify_bytes(memoryview(data), expected, uri)
                return ipc.open_file(data).read_all()
        raw = store.read_bytes(*parts)
        if expected is not None:
            verify_bytes(raw, expected, uri)
        return ipc.open_file(pa.BufferReader(raw)).read_all()
    except pa.ArrowException as exc:
        raise CorruptFileError(uri, f"not a readable Arrow IPC file ({exc})") from exc


def write_samples(
    store: ObjectStore, samples: list[Sample], *parts: str, compression: str | None = "zstd"
) -> str:
    """Refuses a batch holding a NaN/inf reward (`RewardError` naming the sample): generation
    writes its rollout here, so a bad reward hook fails the generate stage before anything
    is stored or trained, and a rerun after fixing the hook generates the step again."""
    for s in samples:
        s.check_reward()
    return write_table(store, samples_to_table(samples), *parts, compression=compression)


def read_samples(store: ObjectStore, *parts: str) -> list[Sample]:
    table = read_table(store, *parts)
    try:
        return table_to_samples(table)
    except (ValueError, KeyError, TypeError) as exc:  # json, missing columns, bad status
        raise CorruptFileError(store.uri(*parts), f"not a sample batch ({exc})") from exc
