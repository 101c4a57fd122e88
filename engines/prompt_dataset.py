"""Prompt datasets (jsonl or parquet) loaded into pending Samples.

Rows are validated while loading, so a bad row fails at start-up with its file, line and
field instead of deep inside a rollout hours later.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from storage.sample import Sample


class DatasetError(ValueError):
    """A bad dataset file or row; `line` 0 means the whole file."""

    def __init__(self, path: str, line: int, field: str, problem: str) -> None:
        super().__init__(f"{path}, line {line}, field {field!r}: {problem}")
        self.path, self.line, self.field, self.problem = path, line, field, problem

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the init arguments: the default pickles `args` (the one message),
        # which this __init__ cannot take, and Ray would show `UnserializableException`.
        return type(self), (self.path, self.line, self.field, self.problem), vars(self)


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


def iter_rows(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, row) pairs; line numbers are 1-based file lines (row numbers for
    parquet)."""
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(path, lineno, "(row)", f"not valid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise DatasetError(path, lineno, "(row)", "a row must be a JSON object")
                yield lineno, row
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield i, row
    else:
        raise DatasetError(path, 0, "(file)", "expected a .jsonl or .parquet file")


def _check_messages(path: str, line: int, field: str, prompt: list[Any]) -> None:
    for m in prompt:
        if not (isinstance(m, dict) and "role" in m and "content" in m):
            raise DatasetError(path, line, field, "chat messages need 'role' and 'content'")


def load_prompt_samples(spec: DatasetSpec, tokenizer: PromptTokenizer | None) -> list[Sample]:
    """Pending samples, one per usable row; `tokens` holds the prompt ids when a tokenizer
    is given. Prompts over `max_prompt_len` tokens are dropped, as slime does."""
    samples: list[Sample] = []
    for line, row in iter_rows(spec.path):
        if spec.input_key not in row:
            raise DatasetError(spec.path, line, spec.input_key, "missing")
        prompt = row[spec.input_key]
        if isinstance(prompt, list):
            _check_messages(spec.path, line, spec.input_key, prompt)
            if not spec.apply_chat_template:
                raise DatasetError(
                    spec.path, line, spec.input_key,
                    "chat messages need data.apply_chat_template: true",
                )
        elif not isinstance(prompt, str):
            raise DatasetError(spec.path, line, spec.input_key, "must be a string or messages")
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
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        tokens = tokenizer.encode(text, add_special_tokens=False) if tokenizer else []
        if spec.max_prompt_len is not None and len(tokens) > spec.max_prompt_len:
            continue
        samples.append(
            Sample(index=-1, group_index=-1, prompt=text, tokens=tokens, label=label,
                   metadata={**metadata, "source_line": line})
        )
    if not samples:
        raise DatasetError(spec.path, 0, "(file)", "no usable rows")
    return samples
