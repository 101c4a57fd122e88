"""Samples <-> Arrow tables, one row per sample, with an exact round trip.

Prompts that are chat messages and dict rewards do not fit a fixed column type, so they go
in JSON side columns (`prompt_json`, `reward_json`) and the plain columns stay typed for the
common case (string prompt, float reward) that tools like pandas/duckdb read directly.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from storage.sample import Sample, Status

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
    ],
    metadata={"rollflow.schema": "sample/1"},
)


def samples_to_table(samples: list[Sample]) -> pa.Table:
    cols: dict[str, list[Any]] = {name: [] for name in SAMPLE_SCHEMA.names}
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
    return pa.Table.from_pydict(cols, schema=SAMPLE_SCHEMA)


def table_to_samples(table: pa.Table) -> list[Sample]:
    missing = set(SAMPLE_SCHEMA.names) - set(table.schema.names)
    if missing:
        raise ValueError(f"not a sample table: missing columns {sorted(missing)}")
    rows = table.to_pylist()
    out = []
    for row in rows:
        prompt = row["prompt"] if row["prompt_json"] is None else json.loads(row["prompt_json"])
        reward = row["reward"] if row["reward_json"] is None else json.loads(row["reward_json"])
        out.append(
            Sample(
                index=row["index"],
                group_index=row["group_index"],
                prompt=prompt,
                tokens=row["tokens"],
                response=row["response"],
                response_length=row["response_length"],
                label=row["label"],
                reward=reward,
                loss_mask=row["loss_mask"],
                rollout_log_probs=row["rollout_log_probs"],
                status=Status(row["status"]),
                weight_version=row["weight_version"],
                metadata=json.loads(row["metadata"]),
            )
        )
    return out
