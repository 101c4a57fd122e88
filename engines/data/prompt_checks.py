"""Every row of a prompt set checked before step 0, in seconds on millions of rows.

`check_fields` checks what can be checked without a tokenizer (the prompt is there, a
non-blank string or well-formed chat messages, the label a string or number, the metadata an
object) and collects each row's `metadata.rm_type`, which preflight needs to know every row
has a reward function. Where the columns have plain types (a string prompt, a scalar label,
a struct metadata: parquet and Arrow files as written, JSON Lines as Arrow's JSON reader
types them, block by block) they are checked whole with Arrow compute; any row they flag is
then re-checked by the same row check the lazy loader uses, so the error (file, row, field,
problem) is the one a row-by-row check would give. Other sets (chat messages, JSON that
Arrow cannot type per column) are checked row by row in batches, never holding more than one
batch as dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.data.prompt_files import ArrowShard, DatasetSpec, JsonlShard, PromptRows, location

RowCheck = Callable[[DatasetSpec, str, int, dict[str, Any]], dict[str, Any]]
"""(spec, file, line, row) -> the row's metadata; raises DatasetError on a bad row."""


@dataclass
class FieldReport:
    rows: int = 0
    rm_types: dict[str, str] = field(default_factory=dict)
    """Each `metadata.rm_type` value -> where it first appears (to name a bad one)."""
    without_rm_type: str | None = None
    """Where the first row without a `metadata.rm_type` is (None: every row has one)."""
    labelled: int = 0
    """Rows with a label (`label_key` present and not null): rule rewards score the rest 0."""
    fields: list[str] = field(default_factory=list)
    """The rows' field names, to suggest the right key when one is missing."""
    vectorised: bool = False

    def saw_fields(self, names: Any) -> None:
        self.fields.extend(n for n in names if n not in self.fields)

    def note(self, where: str, rm_type: Any) -> None:
        if rm_type:
            self.rm_types.setdefault(str(rm_type), where)
        elif self.without_rm_type is None:
            self.without_rm_type = where


def check_fields(rows: PromptRows, spec: DatasetSpec, check_row: RowCheck) -> FieldReport:
    """Check every row of `rows` (see the module docstring); raises on the first bad one."""
    report = _check_columns(rows, spec, check_row)
    if report is not None:
        return report
    report = FieldReport(rows=len(rows))
    for batch in rows.batches():
        if batch:
            report.saw_fields(batch[0][2])
        for file, line, row in batch:
            metadata = check_row(spec, file, line, row)
            report.note(location(file, line), metadata.get("rm_type"))
            report.labelled += spec.label_key is not None and row.get(spec.label_key) is not None
    return report


def _check_columns(rows: PromptRows, spec: DatasetSpec, check_row: RowCheck) -> FieldReport | None:
    """The Arrow-compute path; None when some shard needs the row-by-row check."""
    import pyarrow as pa

    report, offset = FieldReport(rows=len(rows), vectorised=True), 0
    for shard in rows.shards:
        if not isinstance(shard, ArrowShard | JsonlShard):
            return None  # rows made when read (reasoning_gym://): checked one by one
        seen = 0
        try:
            for batch in _column_batches(shard):
                prompt = _column(batch, spec.input_key)
                if prompt is None:  # no row of the batch has the key: the row check says so
                    check_row(spec, *rows.rows([offset + seen])[0])
                if not _plain(batch, spec):
                    return None
                for i in _suspects(prompt):
                    # a null or blank-looking prompt: the row check names the exact problem
                    check_row(spec, *rows.rows([offset + seen + int(i)])[0])
                report.saw_fields(batch.schema.names)
                label = _column(batch, spec.label_key)
                report.labelled += 0 if label is None else batch.num_rows - label.null_count
                meta = _column(batch, spec.metadata_key)
                _note_rm_types(report, shard.name, meta, batch.num_rows,
                               lambda i, base=seen, s=shard: s.line(base + i))
                seen += batch.num_rows
        except pa.ArrowInvalid:  # JSON whose values Arrow cannot type per column
            return None
        if seen != shard.num_rows:
            return None
        offset += shard.num_rows
    return report


def _column_batches(shard: Any) -> Iterator[Any]:
    """The shard as Arrow tables: itself if Arrow, else its JSON Lines parsed by Arrow's
    streaming JSON reader over the same bytes (16 MiB blocks, nothing copied)."""
    import pyarrow as pa
    import pyarrow.json as pj

    if isinstance(shard, ArrowShard):
        yield shard.table
        return
    assert isinstance(shard, JsonlShard)
    if not len(shard.data):
        return
    options = pj.ReadOptions(block_size=1 << 24, use_threads=False)
    yield from pj.open_json(pa.BufferReader(pa.py_buffer(shard.data)), read_options=options)


def _column(batch: Any, key: str | None) -> Any:
    return batch.column(key) if key is not None and key in batch.schema.names else None


def _plain(batch: Any, spec: DatasetSpec) -> bool:
    """Types whose every value passes the row check: a string prompt (nulls and blanks are
    looked at one by one), a scalar label, an object (struct) metadata."""
    import pyarrow as pa

    label, meta = _column(batch, spec.label_key), _column(batch, spec.metadata_key)
    return (_is_text(_column(batch, spec.input_key).type)
            and (label is None or _is_scalar(label.type))
            and (meta is None or pa.types.is_null(meta.type) or pa.types.is_struct(meta.type)))


def _is_text(t: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t))


def _is_scalar(t: Any) -> bool:
    import pyarrow as pa

    return bool(_is_text(t) or pa.types.is_integer(t) or pa.types.is_floating(t)
                or pa.types.is_boolean(t) or pa.types.is_null(t))


def _suspects(prompt: Any) -> np.ndarray:
    """Rows whose prompt is null or only whitespace."""
    import pyarrow.compute as pc

    blank = pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(prompt)), 0)
    bad = pc.or_kleene(pc.is_null(prompt), pc.fill_null(blank, True))
    return np.flatnonzero(bad.to_numpy(zero_copy_only=False))


def _note_rm_types(report: FieldReport, file: str, meta: Any, n: int, line: Any) -> None:
    """`metadata.rm_type` of every row, from the struct column (no Python row objects)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    names = [] if meta is None or pa.types.is_null(meta.type) else [
        meta.type.field(i).name for i in range(meta.type.num_fields)]
    if "rm_type" not in names:
        if n:
            report.note(location(file, line(0)), None)
        return
    values = pc.struct_field(meta, "rm_type").cast(pa.string())
    missing = np.flatnonzero(pc.fill_null(pc.equal(pc.utf8_length(values), 0), True)
                             .to_numpy(zero_copy_only=False))
    if len(missing):
        report.note(location(file, line(int(missing[0]))), None)
    unique = pc.unique(values.drop_null())
    for value in unique.to_pylist():
        if value:
            first = pc.index(values, value).as_py()
            report.note(location(file, line(int(first))), value)
