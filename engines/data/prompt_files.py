"""Where prompt rows come from, kept out of Python objects until they are asked for.

A prompt set is one file (`.jsonl`/`.json`, `.parquet`, `.arrow`), a directory or glob of such
shards (read in sorted path order, so the row order never depends on a listing), a Hugging
Face `datasets` dataset written by `save_to_disk` (a `DatasetDict` by split), or a dataset in
the local hub cache (`hf://datasets/org/name[/config]`), or a reasoning-gym task generated
when read (`reasoning_gym://<task>?seed=S`, `engines.data.reasoning_gym`), or the tasks of an
environment (`verifiers://...`, `openenv://...`, `pkg.module:factory`: engines/environments/).
Local paths and `s3://...` URIs alike go through `storage.object_store.open_store` with the
run's endpoint and options.

Why lazy: a multi-million-row set as `Sample` objects costs gigabytes and minutes before the
first step. Arrow shards stay Arrow (memory-mapped where the file allows: `.arrow` and
`save_to_disk` files); JSON Lines stay raw bytes over a memory map (a local file) plus one
offset per row, found with numpy. `PromptRows.rows(indices)` turns just those rows into
dicts, with the file and 1-based line (row, for Arrow formats) each came from, so a bad row
is reported where it is, whenever it is read.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Protocol

import numpy as np

from engines.config.rollout import is_environment_uri
from engines.data.reasoning_gym import TaskShard, TaskUriError, is_task_uri
from engines.environments.base import EnvironmentError
from engines.environments.rows import EnvironmentShard
from storage.object_store import ObjectStore, open_store

JSON_SUFFIXES = (".jsonl", ".json")
ARROW_SUFFIXES = (".parquet", ".arrow")
HUB_PREFIX = "hf://datasets/"


class DatasetError(ValueError):
    """A bad dataset file or row; `line` 0 means the whole file, a `field` in parentheses
    (`(file)`, `(row)`) the file or row as a whole."""

    def __init__(self, path: str, line: int, field: str, problem: str) -> None:
        super().__init__(f"{location(path, line, field)}: {problem}")
        self.path, self.line, self.field, self.problem = path, line, field, problem

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the init arguments: the default pickles `args` (the one message),
        # which this __init__ cannot take, and Ray would show `UnserializableException`.
        return type(self), (self.path, self.line, self.field, self.problem), vars(self)


def location(path: str, line: int, field: str = "(row)") -> str:
    """`train.jsonl, line 3, field 'prompt'`; rows of Arrow formats are rows, not lines, and
    the placeholders for a whole file or row are left out (`train.jsonl: no rows`)."""
    where = path
    if line:
        where += f", {'line' if PurePosixPath(path).suffix.lower() in JSON_SUFFIXES else 'row'} {line}"
    if not field.startswith("("):
        where += f", field {field!r}"
    return where


@dataclass(frozen=True)
class DatasetSpec:
    path: str
    input_key: str = "prompt"
    label_key: str | None = "label"
    metadata_key: str | None = "metadata"
    apply_chat_template: bool = False
    max_prompt_len: int | None = None
    config_key: str = "data"
    """The config section these settings came from (e.g. `eval.datasets[0]`), so that an
    error names the key the user has to change."""
    split: str | None = None
    """Split of a dataset with several (a `DatasetDict` directory, a hub dataset)."""
    endpoint_url: str | None = None
    storage_options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """How `s3://...` paths are reached: the run's storage section."""

    @property
    def keys(self) -> tuple[str, ...]:
        """The columns a row is read for (the rest of a wide set is never loaded)."""
        return tuple(k for k in (self.input_key, self.label_key, self.metadata_key) if k)


Row = tuple[str, int, dict[str, Any]]
"""(file, 1-based line or row in it, the row)."""


class Shard(Protocol):
    name: str
    num_rows: int

    def line(self, i: int) -> int: ...

    def rows(self, local: np.ndarray) -> list[dict[str, Any]]: ...


class JsonlShard:
    """JSON Lines kept as bytes (a memory map for a local file) and parsed per row read."""

    def __init__(self, name: str, data: bytes | mmap.mmap) -> None:
        self.name, self.data = name, data
        self._starts, self._lines = _row_offsets(data)
        self.num_rows = len(self._starts)

    def line(self, i: int) -> int:
        return int(self._lines[i])

    def rows(self, local: np.ndarray) -> list[dict[str, Any]]:
        return [self._parse(i, self._line_bytes(int(self._starts[i]))) for i in map(int, local)]

    def _line_bytes(self, start: int) -> bytes:
        end = self.data.find(b"\n", start)
        return self.data[start:end if end >= 0 else len(self.data)]

    def _parse(self, i: int, raw: bytes) -> dict[str, Any]:
        line = self.line(i)
        try:
            text = raw.decode("utf-8")  # first, so that a decoding error names its line
        except UnicodeDecodeError:
            raise DatasetError(self.name, line, "(row)", "not UTF-8 text") from None
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            # e's own "line 1 column 21" would read as another line of the file
            raise DatasetError(self.name, line, "(row)",
                               f"not valid JSON at column {e.colno}: {e.msg}") from None
        if not isinstance(row, dict):
            hint = " (one per line: JSON Lines, not a JSON array)" if isinstance(row, list) else ""
            raise DatasetError(self.name, line, "(row)", f"a row must be a JSON object{hint}")
        return row


def _row_offsets(data: bytes | mmap.mmap, chunk: int = 1 << 24) -> tuple[np.ndarray, np.ndarray]:
    """(start byte, 1-based line number) of every non-blank line, scanned in chunks so the
    temporaries stay small next to a multi-gigabyte file."""
    if not len(data):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    view = np.frombuffer(data, dtype=np.uint8)
    newlines = [np.flatnonzero(view[o:o + chunk] == 10) + o for o in range(0, len(view), chunk)]
    ends = np.concatenate([*newlines, np.array([len(view)], np.int64)]).astype(np.int64)
    starts = np.concatenate([[0], ends[:-1] + 1]).astype(np.int64)
    lines = np.arange(1, len(starts) + 1, dtype=np.int64)
    # Blank candidates: empty, or starting with whitespace; only those are looked at closely.
    length = ends - starts
    first = view[np.minimum(starts, len(view) - 1)]
    maybe = np.flatnonzero((length == 0) | np.isin(first, (9, 11, 12, 13, 32)))
    blank = [i for i in maybe if not bytes(data[starts[i]:ends[i]]).strip()]
    keep = np.ones(len(starts), bool)
    keep[blank] = False
    return starts[keep], lines[keep]


class ArrowShard:
    """A table (parquet read into Arrow memory, `.arrow` memory-mapped), converted per take."""

    def __init__(self, name: str, table: Any) -> None:
        self.name, self.table = name, table
        self.num_rows = table.num_rows

    def line(self, i: int) -> int:
        return i + 1

    def rows(self, local: np.ndarray) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self.table.take(local).to_pylist()
        return rows


class PromptRows:
    """Every row of a prompt set, in order, across its shards; dicts only for rows read."""

    def __init__(self, name: str, shards: Sequence[Shard]) -> None:
        self.name, self.shards = name, list(shards)
        self._starts = np.cumsum([0, *[s.num_rows for s in self.shards]]).astype(np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def rows(self, indices: Sequence[int] | np.ndarray) -> list[Row]:
        """Rows `indices` (global, any order) as (file, line, dict), in the order asked."""
        idx = np.asarray(indices, dtype=np.int64)
        which = np.searchsorted(self._starts, idx, side="right") - 1
        out: list[Row | None] = [None] * len(idx)
        for k in np.unique(which):
            positions = np.flatnonzero(which == k)
            shard, local = self.shards[k], idx[positions] - self._starts[k]
            for pos, i, row in zip(positions, local, shard.rows(local), strict=True):
                out[pos] = (shard.name, shard.line(int(i)), row)
        return [r for r in out if r is not None]

    def batches(self, size: int = 1 << 15, limit: int | None = None) -> Iterator[list[Row]]:
        """All rows (or the first `limit`) in order, `size` at a time."""
        end = len(self) if limit is None else min(limit, len(self))
        for start in range(0, end, size):
            yield self.rows(np.arange(start, min(start + size, end)))


# -- opening a set -----------------------------------------------------------------------
def open_rows(spec: DatasetSpec) -> PromptRows:
    """The rows of `spec.path` (see the module docstring for what it may name)."""
    if spec.path.startswith(HUB_PREFIX):
        return PromptRows(spec.path, [_hub_dataset(spec)])
    if is_task_uri(spec.path):
        return PromptRows(spec.path, [_task_shard(spec)])
    if is_environment_uri(spec.path):
        return PromptRows(spec.path, [_environment_shard(spec)])
    store = open_store(spec.path, spec.endpoint_url, **dict(spec.storage_options))
    fs, root = store.fs, store.path()
    if any(c in spec.path for c in "*?["):
        files = sorted(str(f) for f in fs.glob(root))
        shard_files = [f for f in files if _is_data_file(f)]
        if not shard_files:
            raise DatasetError(spec.path, 0, "(file)", "the pattern matches no .jsonl, .json, "
                               ".parquet or .arrow file")
        return PromptRows(spec.path, [_open_file(store, f, spec) for f in shard_files])
    if not fs.exists(root):
        raise DatasetError(spec.path, 0, "(file)", "No such file or directory")
    if not fs.isdir(root):
        return PromptRows(spec.path, [_open_file(store, root, spec)])
    if fs.exists(f"{root}/dataset_dict.json"):
        root = _split_dir(store, root, spec)
    if fs.exists(f"{root}/state.json"):
        return PromptRows(spec.path, _saved_dataset(store, root, spec))
    found = sorted(str(f) for f in fs.find(root) if _is_data_file(str(f)))
    if not found:
        raise DatasetError(spec.path, 0, "(file)", "no .jsonl, .json, .parquet or .arrow file "
                           "in this directory")
    return PromptRows(spec.path, [_open_file(store, f, spec) for f in found])


def _is_data_file(path: str) -> bool:
    name = PurePosixPath(path).name
    hidden = name.startswith((".", "_"))  # _SUCCESS, .crc files of Spark and Hadoop writers
    return not hidden and name.lower().endswith(JSON_SUFFIXES + ARROW_SUFFIXES)


def _display(store: ObjectStore, path: str) -> str:
    return path if store.protocol == "file" else f"{store.protocol}://{path}"


def _open_file(store: ObjectStore, path: str, spec: DatasetSpec) -> Shard:
    import pyarrow as pa

    name = _display(store, path)
    suffix = PurePosixPath(path).suffix.lower()
    if suffix not in JSON_SUFFIXES + ARROW_SUFFIXES:
        raise DatasetError(name, 0, "(file)", "expected a .jsonl, .json, .parquet or .arrow "
                           "file (or a directory of them)")
    try:
        if suffix in JSON_SUFFIXES:
            return JsonlShard(name, _bytes(store, path))
        table = _read_parquet(store, path, spec) if suffix == ".parquet" else _read_arrow(store, path)
    except OSError as e:
        raise DatasetError(name, 0, "(file)", e.strerror or str(e)) from None
    except pa.ArrowException as e:
        raise DatasetError(name, 0, "(file)", f"not a readable {suffix[1:]} file: {e}") from None
    return ArrowShard(name, _project(name, table, spec))


def _bytes(store: ObjectStore, path: str) -> bytes | mmap.mmap:
    """A local file memory-mapped (pages come and go with the OS cache); a remote one read."""
    if store.protocol != "file":
        return bytes(store.fs.cat_file(path))
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _read_parquet(store: ObjectStore, path: str, spec: DatasetSpec) -> Any:
    import pyarrow.parquet as pq

    fs = None if store.protocol == "file" else store.fs
    names = pq.read_schema(path, filesystem=fs).names
    _require_column(_display(store, path), names, spec)
    return pq.read_table(path, columns=[k for k in spec.keys if k in names], filesystem=fs,
                         memory_map=fs is None)


def _read_arrow(store: ObjectStore, path: str) -> Any:
    """An Arrow IPC file or stream (`save_to_disk` writes streams), memory-mapped if local."""
    import pyarrow as pa

    source = (pa.memory_map(path) if store.protocol == "file"
              else pa.BufferReader(store.fs.cat_file(path)))
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def _project(name: str, table: Any, spec: DatasetSpec) -> Any:
    """Only the columns a row is read for (a no-op for zero-copy memory-mapped tables)."""
    _require_column(name, table.column_names, spec)
    return table.select([k for k in spec.keys if k in table.column_names])


def _require_column(name: str, columns: list[str], spec: DatasetSpec) -> None:
    """A typed file without the prompt column fails once, listing what it has, instead of
    once per row."""
    if spec.input_key not in columns:
        raise DatasetError(name, 0, spec.input_key, f"no such column; columns: {columns} "
                           f"(set {spec.config_key}.input_key)")


def _split_dir(store: ObjectStore, root: str, spec: DatasetSpec) -> str:
    """The directory of the split `spec.split` picks in a `DatasetDict.save_to_disk` dir."""
    splits = list(json.loads(store.fs.cat_file(f"{root}/dataset_dict.json"))["splits"])
    return f"{root}/{_pick_split(splits, spec)}"


def _pick_split(splits: list[str], spec: DatasetSpec) -> str:
    wanted = spec.split or (splits[0] if len(splits) == 1 else
                            "test" if spec.config_key.startswith("eval") else "train")
    if wanted not in splits:
        raise DatasetError(spec.path, 0, "(file)", f"no split {wanted!r}; splits: {splits} (set "
                           f"{spec.config_key}.split)")
    return wanted


def _saved_dataset(store: ObjectStore, root: str, spec: DatasetSpec) -> list[Shard]:
    """The Arrow files of a `Dataset.save_to_disk` directory, in the order its state lists."""
    state = json.loads(store.fs.cat_file(f"{root}/state.json"))
    return [_open_file(store, f"{root}/{f['filename']}", spec) for f in state["_data_files"]]


def _task_shard(spec: DatasetSpec) -> Shard:
    """`reasoning_gym://<task>?seed=S&...`: entries generated when read (a bad parameter
    fails here, naming the URI and the config key that holds it)."""
    try:
        return TaskShard(spec.path, spec.input_key, spec.label_key, spec.metadata_key)
    except TaskUriError as e:
        key = "data.prompt_data" if spec.config_key == "data" else f"{spec.config_key}.path"
        raise DatasetError(spec.path, 0, "(file)", f"{e.problem} ({key})") from None


def _environment_shard(spec: DatasetSpec) -> Shard:
    """An environment's tasks (`rollout.environment`): split 'train' for data.prompt_data,
    'eval' for an eval.datasets entry, unless the entry names its split."""
    split = spec.split or ("train" if spec.config_key == "data" else "eval")
    if split not in ("train", "eval"):
        raise DatasetError(spec.path, 0, "(file)", f"split {split!r}: an environment has "
                           f"'train' and 'eval' tasks (set {spec.config_key}.split)")
    try:
        return EnvironmentShard(spec.path, "train" if split == "train" else "eval",
                                spec.input_key, spec.label_key, spec.metadata_key)
    except EnvironmentError as e:
        key = "data.prompt_data" if spec.config_key == "data" else f"{spec.config_key}.path"
        raise DatasetError(spec.path, 0, "(file)", f"{e.problem} ({key})") from None


def _hub_dataset(spec: DatasetSpec) -> Shard:
    """`hf://datasets/org/name[/config]` from the local hub cache (never downloaded here:
    an actor on a node without network would hang instead of failing)."""
    parts = spec.path[len(HUB_PREFIX):].strip("/").split("/")
    if len(parts) not in (2, 3):
        raise DatasetError(spec.path, 0, "(file)", "expected hf://datasets/org/name[/config]")
    repo, config = "/".join(parts[:2]), (parts[2] if len(parts) == 3 else None)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        local = snapshot_download(repo, repo_type="dataset", local_files_only=True)
    except LocalEntryNotFoundError:
        raise DatasetError(spec.path, 0, "(file)", f"not in the local hub cache (download it "
                           f"first: `hf download {repo} --repo-type dataset`)") from None
    import datasets

    by_split = datasets.load_dataset(local, config)  # Arrow, memory-mapped from HF's cache
    table = by_split[_pick_split(list(by_split), spec)].data.table  # (no indices mapping)
    return ArrowShard(spec.path, _project(spec.path, table, spec))
