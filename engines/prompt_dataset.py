"""Prompt datasets (jsonl or parquet) loaded into pending Samples.

Rows are validated while loading, so a bad row fails at start-up with its file, line and
field instead of deep inside a rollout hours later.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from storage.sample import Sample

logger = logging.getLogger(__name__)


class DatasetError(ValueError):
    """A bad dataset file or row; `line` 0 means the whole file, a `field` in parentheses
    (`(file)`, `(row)`) the file or row as a whole."""

    def __init__(self, path: str, line: int, field: str, problem: str) -> None:
        super().__init__(f"{_location(path, line, field)}: {problem}")
        self.path, self.line, self.field, self.problem = path, line, field, problem

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the init arguments: the default pickles `args` (the one message),
        # which this __init__ cannot take, and Ray would show `UnserializableException`.
        return type(self), (self.path, self.line, self.field, self.problem), vars(self)


def _location(path: str, line: int, field: str) -> str:
    """`train.jsonl, line 3, field 'prompt'`; parquet rows are rows, not lines, and the
    placeholders for a whole file or row are left out (`train.jsonl: no rows`)."""
    where = path
    if line:
        where += f", {'row' if Path(path).suffix.lower() == '.parquet' else 'line'} {line}"
    if not field.startswith("("):
        where += f", field {field!r}"
    return where


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


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


@dataclass(frozen=True)
class LoadedPrompts:
    samples: list[Sample]
    dropped_too_long: int
    """Rows dropped for prompts over `max_prompt_len` tokens: reported, never silent."""


def iter_rows(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs; line numbers are 1-based file lines (row numbers for
    parquet)."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        yield from _jsonl_rows(path)
    elif suffix == ".parquet":
        yield from enumerate(_read_parquet(path).to_pylist(), start=1)
    else:
        raise DatasetError(path, 0, "(file)", "expected a .jsonl or .parquet file")


def _jsonl_rows(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        data = Path(path).read_bytes()  # bytes, so that a decoding error has an exact line
    except OSError as e:
        raise DatasetError(path, 0, "(file)", e.strerror or str(e)) from None
    for lineno, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DatasetError(path, lineno, "(row)", "not UTF-8 text") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            # e's own "line 1 column 21" would read as another line of the file
            raise DatasetError(path, lineno, "(row)",
                               f"not valid JSON at column {e.colno}: {e.msg}") from None
        if not isinstance(row, dict):
            hint = " (one per line: JSON Lines, not a JSON array)" if isinstance(row, list) else ""
            raise DatasetError(path, lineno, "(row)", f"a row must be a JSON object{hint}")
        yield lineno, row


def _read_parquet(path: str) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except OSError as e:
        raise DatasetError(path, 0, "(file)", e.strerror or str(e)) from None
    except pa.ArrowException as e:
        raise DatasetError(path, 0, "(file)", f"not a readable parquet file: {e}") from None


def _check_columns(spec: DatasetSpec) -> None:
    """A parquet file without the prompt column fails once, listing what it has, instead of
    once per row."""
    if Path(spec.path).suffix.lower() != ".parquet":
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        columns = pq.read_schema(spec.path).names
    except (OSError, pa.ArrowException):  # unreadable: _read_parquet says why
        return
    if spec.input_key not in columns:
        raise DatasetError(
            spec.path, 0, spec.input_key,
            f"no such column; columns: {columns} (set {spec.config_key}.input_key)",
        )


def _check_messages(path: str, line: int, field: str, prompt: list[Any]) -> None:
    for m in prompt:
        if not (isinstance(m, dict) and "role" in m and "content" in m):
            raise DatasetError(path, line, field, "chat messages need 'role' and 'content'")


def _is_blank(content: Any) -> bool:
    return content is None or (isinstance(content, str) and not content.strip())


def _check_prompt(spec: DatasetSpec, line: int, prompt: Any) -> None:
    """Reject prompts that would fail (or train on nothing) only once a step generates."""
    if isinstance(prompt, list):
        _check_messages(spec.path, line, spec.input_key, prompt)
        if all(_is_blank(m["content"]) for m in prompt):
            raise DatasetError(spec.path, line, spec.input_key, "empty prompt")
        if not spec.apply_chat_template:
            raise DatasetError(
                spec.path, line, spec.input_key,
                f"chat messages need {spec.config_key}.apply_chat_template: true",
            )
    elif not isinstance(prompt, str):
        raise DatasetError(spec.path, line, spec.input_key, "must be a string or messages")
    elif _is_blank(prompt):
        raise DatasetError(spec.path, line, spec.input_key, "empty prompt")


def _check_chat_template(spec: DatasetSpec, tokenizer: PromptTokenizer | None) -> None:
    """A base model's tokenizer often has no chat template: say which key asks for one,
    instead of transformers' ValueError from the first row."""
    if spec.apply_chat_template and getattr(tokenizer, "chat_template", "") is None:
        raise DatasetError(
            spec.path, 0, "(file)",
            f"{spec.config_key}.apply_chat_template is true, but the model's tokenizer has no "
            "chat template (set it false, or give the tokenizer a chat_template)",
        )


def _render_chat(spec: DatasetSpec, line: int, prompt: Any, tokenizer: PromptTokenizer) -> Any:
    """The row through the chat template; a template that cannot render it (e.g. one that
    raises on a system role, or on roles that do not alternate) fails with its line."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2's TemplateError, transformers' ValueError, ...
        problem = (str(e).strip().splitlines() or [""])[0]
        raise DatasetError(
            spec.path, line, spec.input_key,
            f"the chat template cannot render it ({spec.config_key}.apply_chat_template): "
            f"{type(e).__name__}: {problem}",
        ) from None


def load_prompt_samples(spec: DatasetSpec, tokenizer: PromptTokenizer | None) -> LoadedPrompts:
    """Pending samples, one per usable row; `tokens` holds the prompt ids when a tokenizer
    is given. Prompts over `max_prompt_len` tokens are dropped, as slime does, and counted
    (a warning, and `LoadedPrompts.dropped_too_long`)."""
    _check_columns(spec)
    _check_chat_template(spec, tokenizer)
    samples: list[Sample] = []
    rows = dropped = 0
    for line, row in iter_rows(spec.path):
        rows += 1
        if spec.input_key not in row:
            raise DatasetError(
                spec.path, line, spec.input_key, f"missing (set {spec.config_key}.input_key)"
            )
        prompt = row[spec.input_key]
        _check_prompt(spec, line, prompt)
        label = None
        if spec.label_key is not None and spec.label_key in row:
            raw_label = row[spec.label_key]
            if raw_label is not None and not isinstance(raw_label, str | int | float):
                raise DatasetError(spec.path, line, spec.label_key, "must be a string or number")
            label = None if raw_label is None else str(raw_label)
        metadata: dict[str, Any] = {}
        if spec.metadata_key is not None and row.get(spec.metadata_key) is not None:
            metadata = row[spec.metadata_key]
            if not isinstance(metadata, dict):
                raise DatasetError(spec.path, line, spec.metadata_key, "must be an object")
        text = prompt
        if spec.apply_chat_template and tokenizer is not None:
            text = _render_chat(spec, line, prompt, tokenizer)
        tokens = tokenizer.encode(text, add_special_tokens=False) if tokenizer else []
        if spec.max_prompt_len is not None and len(tokens) > spec.max_prompt_len:
            dropped += 1
            continue
        samples.append(
            Sample(index=-1, group_index=-1, prompt=text, tokens=tokens, label=label,
                   metadata={**metadata, "source_line": line})
        )
    if rows == 0:
        raise DatasetError(spec.path, 0, "(file)", "no rows")
    if not samples:  # before the warning, which would otherwise be the first line a user sees
        raise DatasetError(
            spec.path, 0, spec.input_key,
            f"no usable rows: all {rows} prompts are longer than {spec.max_prompt_len} tokens",
        )
    if dropped:
        logger.warning("%s: dropped %d of %d prompts longer than %d tokens",
                       spec.path, dropped, rows, spec.max_prompt_len)
    return LoadedPrompts(samples, dropped)


def model_context(model_path: str | None) -> int | None:
    """Positions the model at `model_path` can attend over (None: no model, or it does not
    say)."""
    if model_path is None:
        return None
    from transformers import AutoConfig

    context = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    return int(context) if context else None


def prompt_limit(configured: int | None, context: int | None, max_response_len: int) -> int | None:
    """Longest prompt (tokens) a run keeps: `data.rollout_max_prompt_len` if set, else what
    the model's context leaves after the response budget, so no prompt is trained on with an
    empty or cut response. Below 1 means no prompt fits (the caller reports it)."""
    if configured is not None or context is None:
        return configured
    return context - max_response_len

