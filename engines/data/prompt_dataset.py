"""Prompt sets as pending Samples: opened lazily, rows turned into Samples when drawn.

`open_prompt_dataset` keeps the rows where `engines.data.prompt_files` put them (Arrow, or raw
JSON lines) and `PromptDataset.take(rows)` checks, renders and tokenizes just those rows, so a
multi-million-row set costs no more start-up than a small one. `check_prompt_dataset` is the
driver's check before step 0 (every row's fields; the first `data.preflight_token_rows` rows
through the tokenizer too); `load_prompt_samples` reads a whole (small) set, e.g. an eval set.
A bad row fails with its file, line and field whenever it is read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engines.chat.tokenizer import encode_texts, read_json_object
from engines.config.data import DataConfig
from engines.data.prompt_checks import FieldReport, check_fields
from engines.data.prompt_files import DatasetError, DatasetSpec, PromptRows, open_rows
from storage.config import StorageConfig
from storage.sample import Sample

__all__ = ["DatasetError", "DatasetSpec", "DatasetCheck", "LoadedPrompts", "PromptDataset",
           "check_prompt_dataset", "data_spec", "load_prompt_samples", "model_context", "open_prompt_dataset",
           "prompt_limit"]

logger = logging.getLogger(__name__)


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class LoadedPrompts:
    samples: list[Sample]
    dropped_too_long: int
    """Rows dropped for prompts over `max_prompt_len` tokens: reported, never silent."""


def _check_messages(path: str, line: int, field: str, prompt: list[Any]) -> None:
    for m in prompt:
        if not (isinstance(m, dict) and "role" in m and "content" in m):
            raise DatasetError(path, line, field, "chat messages need 'role' and 'content'")


def _is_blank(content: Any) -> bool:
    return content is None or (isinstance(content, str) and not content.strip())


def _check_prompt(spec: DatasetSpec, file: str, line: int, prompt: Any) -> None:
    """Reject prompts that would fail (or train on nothing) only once a step generates."""
    if isinstance(prompt, list):
        _check_messages(file, line, spec.input_key, prompt)
        if all(_is_blank(m["content"]) for m in prompt):
            raise DatasetError(file, line, spec.input_key, "empty prompt")
        if not spec.apply_chat_template:
            raise DatasetError(
                file, line, spec.input_key,
                f"chat messages need {spec.config_key}.apply_chat_template: true",
            )
    elif not isinstance(prompt, str):
        raise DatasetError(file, line, spec.input_key, "must be a string or messages")
    elif _is_blank(prompt):
        raise DatasetError(file, line, spec.input_key, "empty prompt")


def _check_chat_template(spec: DatasetSpec, tokenizer: PromptTokenizer | None) -> None:
    """A base model's tokenizer often has no chat template: say which key asks for one,
    instead of transformers' ValueError from the first row."""
    if spec.apply_chat_template and getattr(tokenizer, "chat_template", "") is None:
        raise DatasetError(
            spec.path, 0, "(file)",
            f"{spec.config_key}.apply_chat_template is true, but the model's tokenizer has no "
            "chat template (set it false, or give the tokenizer a chat_template)",
        )


def _render_chat(spec: DatasetSpec, file: str, line: int, prompt: Any,
                 tokenizer: PromptTokenizer) -> Any:
    """The row through the chat template; a template that cannot render it (e.g. one that
    raises on a system role, or on roles that do not alternate) fails with its line."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2's TemplateError, transformers' ValueError, ...
        problem = (str(e).strip().splitlines() or [""])[0]
        raise DatasetError(
            file, line, spec.input_key,
            f"the chat template cannot render it ({spec.config_key}.apply_chat_template): "
            f"{type(e).__name__}: {problem}",
        ) from None


def check_row(spec: DatasetSpec, file: str, line: int, row: dict[str, Any]) -> dict[str, Any]:
    """Raise unless the row's fields are usable; returns its metadata (empty if none)."""
    if spec.input_key not in row:
        raise DatasetError(file, line, spec.input_key, f"missing (set {spec.config_key}.input_key)")
    _check_prompt(spec, file, line, row[spec.input_key])
    if spec.label_key is not None:
        label = row.get(spec.label_key)
        if label is not None and not isinstance(label, str | int | float):
            raise DatasetError(file, line, spec.label_key, "must be a string or number")
    metadata = row.get(spec.metadata_key) if spec.metadata_key is not None else None
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise DatasetError(file, line, str(spec.metadata_key), "must be an object")
    return metadata


def to_samples(spec: DatasetSpec, tokenizer: PromptTokenizer | None,
               rows: Sequence[tuple[str, int, dict[str, Any]]],
               source_file: bool = False) -> list[Sample | None]:
    """Each row as a pending Sample, in order (`tokens`: the prompt ids when a tokenizer is
    given; the prompts tokenised in one call, `encode_texts`); None for a row whose prompt
    is over `max_prompt_len` tokens (dropped, as slime does). A bad row raises before any is
    tokenised."""
    checked = []
    for file, line, row in rows:
        metadata = check_row(spec, file, line, row)
        text = row[spec.input_key]
        if spec.apply_chat_template and tokenizer is not None:
            text = _render_chat(spec, file, line, text, tokenizer)
        checked.append((metadata, text))
    ids = (encode_texts(tokenizer, [text for _, text in checked]) if tokenizer is not None
           else [[] for _ in checked])
    samples: list[Sample | None] = []
    for (file, line, row), (metadata, text), tokens in zip(rows, checked, ids, strict=True):
        if spec.max_prompt_len is not None and len(tokens) > spec.max_prompt_len:
            samples.append(None)
            continue
        raw_label = row.get(spec.label_key) if spec.label_key is not None else None
        where = {"source_line": line, **({"source_file": file} if source_file else {})}
        samples.append(Sample(index=-1, group_index=-1, prompt=text, tokens=tokens,
                              label=None if raw_label is None else str(raw_label),
                              metadata={**metadata, **where}))
    return samples


class PromptDataset:
    """A prompt set whose rows become Samples only when taken (`take`), for the data source.
    Holds the rows as `engines.data.prompt_files` opened them, never a list of Samples."""

    def __init__(self, spec: DatasetSpec, tokenizer: PromptTokenizer | None,
                 rows: PromptRows) -> None:
        self.spec, self.tokenizer, self.rows = spec, tokenizer, rows
        self.multi_file = len(rows.shards) > 1

    def __len__(self) -> int:
        return len(self.rows)

    def take(self, indices: Sequence[int] | np.ndarray) -> list[Sample | None]:
        """Samples of rows `indices`, in order; None for a row dropped as too long."""
        return to_samples(self.spec, self.tokenizer, self.rows.rows(indices), self.multi_file)


def open_prompt_dataset(spec: DatasetSpec, tokenizer: PromptTokenizer | None) -> PromptDataset:
    """The set at `spec.path`, opened without reading its rows into Python objects."""
    _check_chat_template(spec, tokenizer)
    rows = open_rows(spec)
    if not len(rows):
        raise DatasetError(spec.path, 0, "(file)", "no rows")
    return PromptDataset(spec, tokenizer, rows)


def load_prompt_samples(spec: DatasetSpec, tokenizer: PromptTokenizer | None,
                        limit: int | None = None) -> LoadedPrompts:
    """Pending samples, one per usable row (of the first `limit`), all in memory: for sets
    read whole, like eval sets. Prompts over `max_prompt_len` tokens are dropped and counted
    (a warning, and `LoadedPrompts.dropped_too_long`)."""
    dataset = open_prompt_dataset(spec, tokenizer)
    samples = [s for batch in dataset.rows.batches(limit=limit)
               for s in to_samples(spec, tokenizer, batch, dataset.multi_file)
               if s is not None]
    rows = min(len(dataset), limit or len(dataset))
    _report_drops(spec, rows, rows - len(samples))
    return LoadedPrompts(samples, rows - len(samples))


def _report_drops(spec: DatasetSpec, rows: int, dropped: int) -> None:
    if rows and dropped == rows:  # before the warning, which would be the first line read
        raise DatasetError(
            spec.path, 0, spec.input_key,
            f"no usable rows: all {rows} prompts are longer than {spec.max_prompt_len} tokens",
        )
    if dropped:
        logger.warning("%s: dropped %d of %d prompts longer than %d tokens",
                       spec.path, dropped, rows, spec.max_prompt_len)


@dataclass(frozen=True)
class DatasetCheck:
    """What the check before step 0 found in one prompt set."""

    fields: FieldReport
    tokenized: int
    """Rows rendered and tokenized (all of a set up to `token_rows` rows)."""
    dropped_too_long: int
    """Of those, prompts over `max_prompt_len` tokens (the rollout actor skips them)."""

    @property
    def rows(self) -> int:
        return self.fields.rows

    @property
    def usable(self) -> int:
        """Rows a step can draw, as far as the tokenized rows tell."""
        return self.rows - self.dropped_too_long


def check_prompt_dataset(spec: DatasetSpec, tokenizer: PromptTokenizer | None,
                         token_rows: int | None = None) -> DatasetCheck:
    """Every row's fields (vectorised where the columns allow), then the first `token_rows`
    rows (None: all) through the chat template and tokenizer, counting prompts too long.
    The rows past `token_rows` are rendered when drawn: a too-long one is skipped then, a
    template error fails the step that draws it, naming its row."""
    dataset = open_prompt_dataset(spec, tokenizer)
    fields = check_fields(dataset.rows, spec, check_row)
    tokenized = dropped = 0
    if tokenizer is not None:
        for batch in dataset.rows.batches(limit=token_rows):
            tokenized += len(batch)
            dropped += sum(s is None for s in to_samples(spec, tokenizer, batch))
        if tokenized == fields.rows:
            _report_drops(spec, tokenized, dropped)
        elif dropped:
            logger.warning("%s: %d of the first %d prompts are longer than %d tokens (the rest "
                           "are checked when drawn)", spec.path, dropped, tokenized,
                           spec.max_prompt_len)
    return DatasetCheck(fields, tokenized, dropped)


def data_spec(data: DataConfig, storage: StorageConfig, max_prompt_len: int | None) -> DatasetSpec:
    """How the training set is read: the data section's keys, s3:// through `storage`."""
    return DatasetSpec(
        path=data.prompt_data, input_key=data.input_key, label_key=data.label_key,
        metadata_key=data.metadata_key, apply_chat_template=data.apply_chat_template,
        max_prompt_len=max_prompt_len, config_key="data", split=data.split,
        endpoint_url=storage.endpoint_url,
        storage_options=storage.options_for(data.prompt_data or ""),
    )


def model_context(model_path: str | None) -> int | None:
    """Positions the model at `model_path` can attend over (None: no model, or it does not
    say): `max_position_embeddings` of a local config.json, read as JSON (AutoConfig would
    import torch); a hub id or a config without the key at its top level (a multimodal one
    nests it) goes through AutoConfig."""
    if model_path is None:
        return None
    config = read_json_object(os.path.join(model_path, "config.json"))
    if config is not None and "max_position_embeddings" in config:
        value = config["max_position_embeddings"]
    else:
        from transformers import AutoConfig

        value = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    return int(value) if value else None


def prompt_limit(configured: int | None, context: int | None, max_response_len: int) -> int | None:
    """Longest prompt (tokens) a run keeps: `data.rollout_max_prompt_len` if set, else what
    the model's context leaves after the response budget, so no prompt is trained on with an
    empty or cut response. Below 1 means no prompt fits (the caller reports it)."""
    if configured is not None or context is None:
        return configured
    return context - max_response_len

