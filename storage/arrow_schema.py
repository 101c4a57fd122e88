"""Samples <-> Arrow tables, one row per sample, with an exact round trip.

Prompts that are chat messages and dict rewards do not fit a fixed column type, so they go
in JSON side columns (`prompt_json`, `reward_json`) and the plain columns stay typed for the
common case (string prompt, float reward) that tools like pandas/duckdb read directly.
An MoE rollout's routed experts are a flat `list<int16>` per row (`RoutedExperts`), null for
dense models; a table written before that column existed reads as none recorded. So does
`token_versions` (each response token's weight version): a table without it reads as
versions not recorded.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa

from storage.sample import RoutedExperts, Sample, Status

SAMPLE_SCHEMA = pa.schema(
    [
        pa.field("index", pa.int64(), nullable=False),
        pa.field("group_index", pa.int64(), nullable=False),
        pa.field("prompt", pa.string()),
        pa.field("prompt_json", pa.string()),
        pa.field("tokens", pa.list_(pa.int32()), nullable=False),
        pa.field("response", pa.string(), nullable=False),
        pa.field("response_length", pa.int32(), nullable=False),
        pa.field("label", pa.string()),
        pa.field("reward", pa.float64()),
        pa.field("reward_json", pa.string()),
        pa.field("loss_mask", pa.list_(pa.int32()), nullable=False),
        pa.field("rollout_log_probs", pa.list_(pa.float32()), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("weight_version", pa.int64(), nullable=False),
        pa.field("metadata", pa.string(), nullable=False),
        pa.field("routed_experts", pa.list_(pa.int16())),
        pa.field("token_versions", pa.list_(pa.int32())),
    ],
    metadata={"rollflow.schema": "sample/1"},
)
_LIST_COLUMNS = ("tokens", "loss_mask", "rollout_log_probs")
_OPTIONAL_COLUMNS = ("routed_experts", "token_versions")


def samples_to_table(samples: list[Sample]) -> pa.Table:
    cols: dict[str, list[Any]] = {name: [] for name in SAMPLE_SCHEMA.names
                                  if name != "routed_experts"}
    for s in samples:
        s.check()
        is_text = isinstance(s.prompt, str)
        is_dict_reward = isinstance(s.reward, dict)
        cols["index"].append(s.index)
        cols["group_index"].append(s.group_index)
        cols["prompt"].append(s.prompt if is_text else None)
        cols["prompt_json"].append(None if is_text else json.dumps(s.prompt, ensure_ascii=False))
        cols["tokens"].append(s.tokens)
        cols["response"].append(s.response)
        cols["response_length"].append(s.response_length)
        cols["label"].append(s.label)
        cols["reward"].append(None if is_dict_reward else s.reward)
        cols["reward_json"].append(json.dumps(s.reward) if is_dict_reward else None)
        cols["loss_mask"].append(s.loss_mask)
        cols["rollout_log_probs"].append(s.rollout_log_probs)
        cols["status"].append(str(s.status))
        cols["weight_version"].append(s.weight_version)
        cols["metadata"].append(json.dumps(s.metadata, ensure_ascii=False, sort_keys=True))
        cols["token_versions"].append(s.token_versions)
    arrays = [pa.array(cols[f.name], type=f.type) if f.name in cols
              else _routed_experts_array(samples) for f in SAMPLE_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=SAMPLE_SCHEMA)


def _routed_experts_array(samples: list[Sample]) -> pa.Array:
    """The routed experts of every row as one list array built from numpy buffers (no
    Python int per id); null where a sample has none."""
    routed = [s.routed_experts for s in samples]
    lengths = np.array([0 if r is None else len(r) for r in routed], dtype=np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int32)]).astype(np.int32)
    present = [r.ids for r in routed if r is not None]
    values = np.concatenate(present) if present else np.zeros(0, dtype=np.int16)
    mask = pa.array([r is None for r in routed], type=pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int16()),
                                    mask=mask)


def numeric_values(array: pa.Array) -> np.ndarray:
    """A null-free integer or float array's values as a numpy view of its data buffer.
    pyarrow's `Array.to_numpy` does the same, but imports pandas on its first call: about
    0.25 CPU-s in every trainer, which has no other use for it (bench/RESULTS.md, "CI cost").
    Anything else (nulls, booleans, strings) goes through `to_numpy`."""
    kind = array.type
    if array.null_count or not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(kind.to_pandas_dtype())
    if not len(array):  # (an empty array may have no data buffer at all)
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array),
                         offset=array.offset * dtype.itemsize)


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Building a batch allocates millions of objects and no reference cycles; the cyclic
    collector would walk them all several times over (about half the time of a read)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def list_values(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (values, row offsets from 0): numpy views of the column's buffers (a
    copy where it has several chunks); row i is `values[offsets[i]:offsets[i + 1]]`."""
    array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    offsets = numeric_values(array.offsets)
    if len(offsets) and offsets[0]:  # a sliced array: its values start at its first offset
        offsets = offsets - offsets[0]
    return numeric_values(array.flatten()), offsets


def _row_lists(column: pa.ChunkedArray) -> list[list[Any]]:
    """A list column as one Python list per row: the flat values convert in one pass (numpy's
    `tolist`), rows are slices of that list."""
    values, offsets = list_values(column)
    flat, bounds = values.tolist(), offsets.tolist()
    return [flat[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _routed_experts_rows(table: pa.Table) -> list[RoutedExperts | None]:
    """Each row's routed experts: int16 slices of the column's one values buffer."""
    if "routed_experts" not in table.schema.names:
        return [None] * table.num_rows
    column = table.column("routed_experts")
    array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if array.null_count == len(array):
        return [None] * table.num_rows
    offsets = numeric_values(array.offsets)
    values = numeric_values(array.values)
    valid = array.is_valid().to_numpy(zero_copy_only=False)
    return [RoutedExperts(values[a:b].copy()) if ok else None
            for a, b, ok in zip(offsets[:-1], offsets[1:], valid, strict=True)]


def table_to_samples(table: pa.Table) -> list[Sample]:
    missing = set(SAMPLE_SCHEMA.names) - set(table.schema.names) - set(_OPTIONAL_COLUMNS)
    if missing:
        raise ValueError(f"not a sample table: missing columns {sorted(missing)}")
    with _gc_paused():
        lists = {name: _row_lists(table.column(name)) for name in _LIST_COLUMNS}
        col = {name: table.column(name).to_pylist() for name in SAMPLE_SCHEMA.names
               if name not in _LIST_COLUMNS and name not in _OPTIONAL_COLUMNS}  # fmt: skip
        routed = _routed_experts_rows(table)
        versions = (_row_lists(table.column("token_versions"))
                    if "token_versions" in table.schema.names else [[]] * table.num_rows)
        out = []
        for i in range(table.num_rows):
            prompt_json, reward_json = col["prompt_json"][i], col["reward_json"][i]
            out.append(
                Sample(
                    index=col["index"][i],
                    group_index=col["group_index"][i],
                    prompt=col["prompt"][i] if prompt_json is None else json.loads(prompt_json),
                    tokens=lists["tokens"][i],
                    response=col["response"][i],
                    response_length=col["response_length"][i],
                    label=col["label"][i],
                    reward=col["reward"][i] if reward_json is None else json.loads(reward_json),
                    loss_mask=lists["loss_mask"][i],
                    rollout_log_probs=lists["rollout_log_probs"][i],
                    status=Status(col["status"][i]),
                    weight_version=col["weight_version"][i],
                    metadata=json.loads(col["metadata"][i]),
                    routed_experts=routed[i],
                    token_versions=list(versions[i]),
                )
            )
    return out
