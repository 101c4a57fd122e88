"""`rollflow train`'s start, told as it happens: a line on stderr as each phase begins
(preflight, the Prefect server, the Ray head, the actors, the first step), with the seconds
since the command started. A start used to print nothing for 30-60 s while it started a head,
a Prefect server and the actors.

Only on a terminal (or with ROLLFLOW_START_LINES=1): a script or CI reading stderr gets what
it always got, a failure's cause as its first line. Off the CLI (a deployment, a library
call) nothing is told.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

FORCE_ENV = "ROLLFLOW_START_LINES"  # 1: tell the start even off a terminal; 0: never
PREFIX = "rollflow: ["
_told: dict[str, object] = {}  # "stream" and "t0" once the CLI asked for the lines


def tell_start(stream: TextIO | None = None) -> None:
    """Called by `rollflow train` first thing: the start's lines go to `stream` (stderr)
    from now on, if it is a terminal or ROLLFLOW_START_LINES=1 asks for them."""
    out = stream or sys.stderr
    forced = os.environ.get(FORCE_ENV, "")
    if forced == "0" or not (forced == "1" or out.isatty()):
        return
    import psutil

    # seconds since the process started, Python's own start-up and imports included
    _told.update(stream=out, t0=psutil.Process().create_time())


def phase(what: str) -> None:
    """One line: `rollflow: [  1.2 s] what` (nothing unless `tell_start` asked for them)."""
    stream = _told.get("stream")
    if stream is None:
        return
    elapsed = time.time() - float(_told["t0"])  # type: ignore[arg-type]
    print(f"{PREFIX}{elapsed:5.1f} s] {what}", file=stream, flush=True)  # type: ignore[call-overload]


def stop_telling() -> None:
    """The start is over (the first step began) or the command ends."""
    _told.clear()
