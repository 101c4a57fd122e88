"""The docs cannot name what does not exist: every config key a doc names (`rollout.max_staleness`,
`--set train.lr=...`) is a field of the run config, every repository path it names in code
spans is there, and every relative link points at a file. A renamed key or a moved module
fails here, not in a reader's shell."""

from __future__ import annotations

import importlib.util
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from flows.config.run import RollflowConfig
from tests.support import REPO_ROOT
from tests.support.doc_blocks import DOC_PAGES

SECTIONS = list(RollflowConfig.model_fields)
KEY = re.compile(r"(?<![\w./$-])(" + "|".join(SECTIONS) + r")\.([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)")
FILE_SUFFIXES = {"arrow", "jsonl", "json", "yaml", "yml", "py", "png", "md", "txt", "csv",
                 "parquet", "safetensors", "sh", "toml", "log"}  # `train.arrow` is a file
TOP_DIRS = ("engines/", "flows/", "tasks/", "storage/", "tests/", "bench/", "scripts/",
            "examples/", "docs/", ".ci/")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _model(annotation: object) -> type[BaseModel] | None:
    for a in [annotation, *typing.get_args(annotation)]:
        if isinstance(a, type) and issubclass(a, BaseModel):
            return a
    return None


def config_key_exists(section: str, path: str) -> bool:
    """Whether `section.path` names a field (a dict-valued field takes any sub-key)."""
    model = _model(RollflowConfig.model_fields[section].annotation)
    for part in path.split("."):
        if model is None:
            return True
        if part not in model.model_fields:
            return False
        model = _model(model.model_fields[part].annotation)
    return True


def code_spans(text: str) -> list[str]:
    """Inline code of the prose (a fenced block's lines are not spans)."""
    spans, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            spans += re.findall(r"`([^`]+)`", line)
    return spans


def named_keys(text: str) -> list[str]:
    """Config keys in code spans and `--set` arguments (not file names, not modules)."""
    spans = code_spans(text) + re.findall(r"--set\s+(\S+)", text)
    keys: list[str] = []
    for span in spans:
        for m in KEY.finditer(span):
            parts = m.group(2).split(".")
            if parts[0] in FILE_SUFFIXES or parts[-1] in FILE_SUFFIXES:
                continue
            if _is_module(m.group(0)):
                continue  # `storage.config.Section`: a module path
            if m.group(0) not in keys:
                keys.append(m.group(0))
    return keys


def _is_module(dotted: str) -> bool:
    """Whether the first two parts name a module (`storage` is a package and a section)."""
    try:
        return importlib.util.find_spec(".".join(dotted.split(".")[:2])) is not None
    except ModuleNotFoundError:
        return False


def named_paths(text: str) -> list[str]:
    """Repository paths in code spans (templates with {k} or * and generated artifacts left
    out)."""
    paths = []
    for span in code_spans(text):
        for word in span.split():
            word = word.removeprefix("./").rstrip(".,:;)").split("::")[0]
            if word.startswith(TOP_DIRS) and not re.search(r"[{}*<>]|artifacts", word):
                paths.append(word)
    return paths


@pytest.mark.parametrize("doc", DOC_PAGES, ids=lambda p: p.name)
def test_every_config_key_a_doc_names_exists(doc: Path) -> None:
    text = doc.read_text()
    unknown = [k for k in named_keys(text) if not config_key_exists(*k.split(".", 1))]
    assert not unknown, f"{doc.name} names config keys that do not exist: {unknown}"


@pytest.mark.parametrize("doc", DOC_PAGES, ids=lambda p: p.name)
def test_every_path_and_link_a_doc_names_is_there(doc: Path) -> None:
    text = doc.read_text()
    missing = [p for p in named_paths(text) if not (REPO_ROOT / p).exists()]
    links = [m for m in LINK.findall(text) if "://" not in m and not m.startswith("mailto:")]
    missing += [m for m in links if not (doc.parent / m).exists()]
    assert not missing, f"{doc.name} names paths that are not in the repository: {missing}"


def test_the_checks_catch_a_stale_name() -> None:
    assert named_keys("set `rollout.use_tis` or `--set train.lr=1`") == [
        "rollout.use_tis", "train.lr"]
    assert not config_key_exists("algorithm", "use_tis")  # renamed: rollout_correction
    assert config_key_exists("train", "lr") and config_key_exists("storage", "storage_options.key")
    assert named_keys("`rollout.arrow`, `storage.config.Section`") == []
    assert named_paths("see `engines/rollout/nowhere.py` and `steps/{k}/x`") == [
        "engines/rollout/nowhere.py"]
