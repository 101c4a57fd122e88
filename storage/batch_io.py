"""Sample batches as Arrow IPC files (compressed), read back zero-copy where possible."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.ipc as ipc

from storage.arrow_schema import samples_to_table, table_to_samples
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


def read_table(store: ObjectStore, *parts: str) -> pa.Table:
    """Local files are memory-mapped (zero-copy for uncompressed buffers); remote ones
    are fetched once into memory."""
    path = store.path(*parts)
    if store.protocol == "file":
        with pa.memory_map(path, "r") as source:
            return ipc.open_file(source).read_all()
    return ipc.open_file(pa.BufferReader(store.read_bytes(*parts))).read_all()


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
    return table_to_samples(read_table(store, *parts))
