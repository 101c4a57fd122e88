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
from dataclasses import dataclass
from typing import TextIO

FORCE_ENV = "ROLLFLOW_START_LINES"  # 1: tell the start even off a terminal; 0: never
PREFIX = "rollflow: ["


@dataclass(frozen=True)
class _Telling:
    stream: TextIO
    started_at: float  # the process's start, epoch seconds


_telling: list[_Telling] = []  # one while the CLI tells its start


def tell_start(stream: TextIO | None = None) -> None:
    """Called by `rollflow train` first thing: the start's lines go to `stream` (stderr)
    from now on, if it is a terminal or ROLLFLOW_START_LINES=1 asks for them."""
    stop_telling()
    out = stream or sys.stderr
    forced = os.environ.get(FORCE_ENV, "")
    if forced == "0" or not (forced == "1" or out.isatty()):
        return
    # seconds since the process started, Python's own start-up and imports included
    _telling.append(_Telling(out, process_started_at()))


def process_started_at() -> float:
    """This process's start, epoch seconds, to the clock tick. psutil's `create_time` adds
    the boot time, which Linux gives in whole seconds: the lines read up to 1 s late."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return time.time() - (uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        import psutil

        return float(psutil.Process().create_time())


def phase(what: str) -> None:
    """One line: `rollflow: [  1.2 s] what` (nothing unless `tell_start` asked for them)."""
    for told in _telling:
        print(f"{PREFIX}{time.time() - told.started_at:5.1f} s] {what}", file=told.stream,
              flush=True)


def stop_telling() -> None:
    """The start is over (the first step began) or the command ends."""
    _telling.clear()
