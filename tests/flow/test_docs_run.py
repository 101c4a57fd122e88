"""The docs' runnable sections run as written: a doc's `file=` blocks are saved and its
`runnable` blocks run in order, in a fresh directory outside the repository, through the
installed `rollflow` command (tests/support/doc_blocks.py says how a doc marks them).

CI adds only what makes them quick and keeps them on the session's servers: the block's own
`quick=` settings, and the session's Ray head and Prefect server, to every `rollflow train`.
The storage layout the README promises is then checked against the run they made.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT
from tests.support.doc_blocks import DOC_PAGES, DocBlock, fenced_blocks, with_train_sets

RUNNABLE = [doc for doc in DOC_PAGES if any(b.runnable for b in fenced_blocks(doc))]
BLOCK_TIMEOUT_S = 240
NAMESPACE = "rollflow-tests"


def test_the_docs_have_runnable_sections():
    """The mark is read: a rename of it would leave this file testing nothing."""
    assert REPO_ROOT / "docs" / "your-own-task.md" in RUNNABLE


def _run_block(block: DocBlock, work: Path, env: dict[str, str], sets: list[str]) -> str:
    script = with_train_sets(block.text, [*sets, *block.quick_sets])
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env,
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, (
        f"{block.where}: the block exited {done.returncode}\n--- block ---\n{script}"
        f"--- last output ---\n{output[-4000:]}")
    return done.stdout


@pytest.fixture
def user_env(prefect_api: str) -> dict[str, str]:
    """The reader's shell: rollflow's environment active, nothing of the repository's."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PREFECT_API_URL"] = prefect_api
    return env


@pytest.mark.parametrize("doc", RUNNABLE, ids=lambda d: d.name)
def test_a_docs_runnable_sections_run_as_written(doc: Path, tmp_path, user_env, ray_address):
    work = tmp_path / "reader"
    work.mkdir()
    session = [f"cluster.address={ray_address}", f"cluster.namespace={NAMESPACE}"]
    outputs = []
    for block in fenced_blocks(doc):
        if block.file_name:
            (work / block.file_name).write_text(block.text)
        elif block.runnable:
            outputs.append(_run_block(block, work, user_env, session))
    if doc.name == "your-own-task.md":
        run = work / "runs" / "first-letter"
        assert (run / "steps" / "000001" / "COMMITTED").exists()
        assert not (run / "steps" / "000002").exists(), "the quick variant trains 2 steps"
        assert re.search(r"first-letter\s+complete", outputs[0]), outputs[0]
        _check_readme_layout(run)


# README's storage layout, entry by entry: what a complete run without a failure leaves. The
# entries left out need an event this run does not have, each named here so that a rename of
# one in the README fails too.
LAYOUT_ONLY_WHEN = {
    "configs/{n}.yaml": "a rerun with a changed config",
    "engines.json": "`rollflow engines add|remove`",
    "logs/error-{time}.log": "a failed command",
    "steps/{rollout_id:06d}/FAILED": "a failed step",
    "steps/{rollout_id:06d}/groups/": "a step not yet committed",
    "datasource/{rollout_id:06d}.{stage}.buffer.arrow": "groups left in the buffer",
}


def readme_layout() -> list[str]:
    """The paths of README's 'What a run leaves in storage', relative to runs/{run}/: one
    per name (a line's first path sets the directory of the bare names after it)."""
    block = next(b for b in fenced_blocks(REPO_ROOT / "README.md")
                 if b.text.startswith("runs/{run}/"))
    paths: list[str] = []
    for line in block.text.splitlines():
        line = re.sub(r"\([^)]*\)", "", line.split("#")[0]).replace(" + ", " ")
        names = [n for n in re.split(r"[\s,]+", line) if n]
        if not names:
            continue
        first = names[0].removeprefix("runs/{run}/")
        base = first.rstrip("/").rpartition("/")[0]
        paths.append(first)
        for name in names[1:]:
            paths.append(name if "/" in name else f"{base}/{name}".lstrip("/"))
    return paths


def _glob(path: str) -> str:
    return re.sub(r"\{rollout_id:06d\}|\{weight_version:06d\}", "[0-9]" * 6,
                  re.sub(r"\{(n|time|digest|stage|task)\}", "*", path)).rstrip("/")


def _check_readme_layout(run: Path) -> None:
    layout = readme_layout()
    for path in LAYOUT_ONLY_WHEN:
        assert path in layout, f"README's storage layout no longer names {path}"
    missing = [p for p in layout if p not in LAYOUT_ONLY_WHEN and not list(run.glob(_glob(p)))]
    assert not missing, f"README names, a run did not make: {missing} (in {run})"
