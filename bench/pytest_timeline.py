"""A pytest plugin for `bench.ci_cost --per-test`: each test's start and end, one JSON line
each, in `$ROLLFLOW_TEST_TIMELINE/<xdist worker>.jsonl` (`main` without xdist).

    pytest -p bench.pytest_timeline ...
"""

from __future__ import annotations

import json
import os
import time
from typing import IO

_OUT: IO[str] | None = None


def _out() -> IO[str] | None:
    global _OUT
    folder = os.environ.get("ROLLFLOW_TEST_TIMELINE")
    if _OUT is None and folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _OUT = open(os.path.join(folder, f"{worker}.jsonl"), "a", buffering=1)  # noqa: SIM115
    return _OUT


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    out = _out()
    if out is not None:
        out.write(json.dumps(["start", nodeid, time.time()]) + "\n")


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    out = _out()
    if out is not None:
        out.write(json.dumps(["end", nodeid, time.time()]) + "\n")
