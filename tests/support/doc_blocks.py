"""The runnable parts of the docs, read from their Markdown.

A doc marks what a reader is meant to run, in its fenced blocks' info strings:

    ```yaml file=first-letter.yaml      a file the reader saves under that name
    ```bash runnable                    commands the reader runs, in order, in one directory
    ```bash runnable quick=rollout.num_rollout=2,eval.eval_interval=1
                                        the same, with `--set`s that CI adds to each
                                        `rollflow train` (a shorter run of the same commands)

GitHub highlights by the first word only, so the marks do not show. tests/flow/test_docs_run.py
writes a doc's files and runs its blocks in a fresh directory outside the repository.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import REPO_ROOT

FENCE = re.compile(r"^(\s*)(`{3,})(.*)$")
# every page a reader reads: what the docs tests check
DOC_PAGES = sorted([REPO_ROOT / "README.md", REPO_ROOT / "ARCHITECTURE.md",
                    REPO_ROOT / "CONTRIBUTING.md", *(REPO_ROOT / "docs").glob("*.md")])


@dataclass(frozen=True)
class DocBlock:
    """One fenced block of a doc: its language, its marks and its text."""

    doc: Path
    line: int  # the 1-based line of the opening fence
    language: str
    marks: dict[str, str] = field(default_factory=dict)
    text: str = ""

    @property
    def runnable(self) -> bool:
        return "runnable" in self.marks

    @property
    def file_name(self) -> str | None:
        return self.marks.get("file")

    @property
    def quick_sets(self) -> list[str]:
        quick = self.marks.get("quick", "")
        return [s for s in quick.split(",") if s]

    @property
    def where(self) -> str:
        return f"{self.doc.name}:{self.line}"


def fenced_blocks(doc: Path) -> list[DocBlock]:
    """Every fenced block of `doc`, in order. An unclosed fence is an error naming its line."""
    blocks: list[DocBlock] = []
    opening: tuple[int, str, str, str] | None = None  # line, indent, fence, info
    body: list[str] = []
    for number, line in enumerate(doc.read_text().splitlines(), start=1):
        m = FENCE.match(line)
        if opening is None:
            if m:
                opening, body = (number, m.group(1), m.group(2), m.group(3).strip()), []
            continue
        if m and m.group(2).startswith(opening[2]) and not m.group(3).strip():
            blocks.append(_block(doc, opening[0], opening[3], body, opening[1]))
            opening = None
        else:
            body.append(line)
    if opening is not None:
        raise ValueError(f"{doc}:{opening[0]}: a fenced block is never closed")
    return blocks


def _block(doc: Path, line: int, info: str, body: list[str], indent: str) -> DocBlock:
    words = shlex.split(info) if info else []
    language = words[0] if words else ""
    marks: dict[str, str] = {}
    for word in words[1:]:
        key, _, value = word.partition("=")
        marks[key] = value
    text = "\n".join(b[len(indent):] if b.startswith(indent) else b for b in body)
    return DocBlock(doc=doc, line=line, language=language, marks=marks, text=text + "\n")


def with_train_sets(script: str, sets: list[str]) -> str:
    """`script` with `--set S` for each S inserted after every `rollflow train` command
    (options may come in any order, so the reader's own flags are kept as written)."""
    if not sets:
        return script
    extra = " ".join(f"--set {shlex.quote(s)}" for s in sets)
    return re.sub(r"(^\s*|&&\s*|;\s*|\|\|\s*)rollflow train(?=\s|$)",
                  lambda m: f"{m.group(1)}rollflow train {extra}", script, flags=re.M)
