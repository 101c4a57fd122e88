"""A training whose Ray head goes away under it (another shell's `rollflow cluster down
--force`, a head that died) ends at once with one line: what happened, and the command that
resumes the run. Ray alone waits 60 s and then dies with `Failed to connect to GCS within 60
seconds`, which names neither the run nor the way back.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engines.cluster.head import watch_head

HEAD_GONE_EXIT = 3  # docs/fault-tolerance.md, "The head went away"


def resume_command(argv: list[str] | None = None) -> str:
    """The command line this process was started with, as a user would type it again:
    `rollflow train ...` for the console script, `python -m module ...` for a module."""
    args = list(sys.orig_argv if argv is None else argv)
    if len(args) > 1 and Path(args[1]).name == "rollflow":
        return shlex.join(["rollflow", *args[2:]])
    if len(args) > 2 and args[1] == "-m":
        return shlex.join(["python", *args[1:]])
    return shlex.join(args)


def head_gone_line(address: str, run_name: str, command: str) -> str:
    return (f"rollflow: the Ray head at {address} is gone (`rollflow cluster down --force`, or "
            f"it died); run {run_name} stopped, its committed steps are kept. "
            f"Resume it with: {command}")


@contextmanager
def exiting_if_head_is_lost(address: str, run_name: str) -> Iterator[None]:
    """Within this block, a lost head (at a `host:port` address) ends the process with
    `head_gone_line` on stderr and exit code HEAD_GONE_EXIT. It is ended from the watch
    thread (os._exit): the main thread is inside a Ray call that returns only after Ray's
    own 60 s, and nothing of the run is lost by not unwinding (every step is committed or
    resumable)."""

    def lost(gone: str) -> None:
        sys.stdout.flush()  # (os._exit flushes nothing: what the run printed comes first)
        sys.stderr.write(head_gone_line(gone, run_name, resume_command()) + "\n")
        sys.stderr.flush()
        os._exit(HEAD_GONE_EXIT)

    if not re.fullmatch(r"[\w.\-]+:\d+", address):  # "auto", a `ray://` client: not watched
        yield
        return
    stop = watch_head(address, lost)
    try:
        yield
    finally:
        stop.set()
