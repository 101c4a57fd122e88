"""Sample batches as Arrow IPC files (compressed), read back zero-copy where possible.

Every read that fails raises one error type, `CorruptFileError`, naming the file: a file that
does not parse as Arrow or as a sample batch, and a file of a committed step whose size or
sha256 differs from those its step's COMMITTED marker recorded (`integrity.py`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from storage.arrow_schema import (
    list_values,
    numeric_values,
    samples_to_table,
    table_to_samples,
)
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


@dataclass(frozen=True, slots=True)
class TokenArrays:
    """A sample batch's per-token columns as flat arrays plus row offsets (row i's tokens are
    `tokens[token_offsets[i]:token_offsets[i + 1]]`, its loss mask and log-probs likewise
    with their own offsets). They are views of the file's buffers: no Python object per row
    or token, and for an uncompressed local file (memory-mapped) no copy at all."""

    tokens: np.ndarray  # int32
    token_offsets: np.ndarray
    response_lengths: np.ndarray  # int32, one per row
    loss_mask: np.ndarray  # int32
    loss_mask_offsets: np.ndarray
    rollout_log_probs: np.ndarray  # float32
    log_prob_offsets: np.ndarray


def token_arrays(table: pa.Table) -> TokenArrays:
    tokens, token_offsets = list_values(table.column("tokens"))
    loss_mask, mask_offsets = list_values(table.column("loss_mask"))
    log_probs, log_prob_offsets = list_values(table.column("rollout_log_probs"))
    lengths = numeric_values(table.column("response_length").combine_chunks())
    return TokenArrays(
        tokens, token_offsets, lengths, loss_mask, mask_offsets, log_probs, log_prob_offsets
    )


def read_token_arrays(store: ObjectStore, *parts: str) -> TokenArrays:
    """The per-token columns of a sample file without building samples (`TokenArrays`)."""
    table = read_table(store, *parts)
    try:
        return token_arrays(table)
    except (KeyError, pa.ArrowException) as exc:
        raise CorruptFileError(store.uri(*parts), f"not a sample batch ({exc})") from exc
