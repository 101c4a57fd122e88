"""How the CLI reports a failure: the cause in one line first, the full story in a log file.

What a user needs is the innermost cause (`DatasetError: train.jsonl, line 3, ...`, found by
flows/bookkeeping/root_cause.py through Ray's and Prefect's wrappers), so the CLI prints that, keeps
the tracebacks in `<run dir>/logs/error-<time>.log` (or `~/.rollflow/logs/`), and holds back
Prefect's console copies of them (the Prefect UI still gets every record).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from flows.bookkeeping.root_cause import exit_code, strip_ansi, summarize
from storage.secrets import scrub


class HeldBack(logging.Filter):
    """Keeps Prefect's failed-run records (ERROR and up, with tracebacks), the task retry
    warnings and the warnings of Prefect's senders draining as the run ends ("EventsWorker -
    Still processing items: 1 items remaining...", which came before a failed run's cause)
    off the console and in memory, for the log file; the console's first line stays the root
    cause, and the UI still shows every record."""

    LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
    SENDERS = ("EventsWorker", "APILogWorker")  # Prefect's queue services, by class name

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        warned = record.name.startswith("prefect.task_runs") or record.name in self.SENDERS
        floor = logging.WARNING if warned else logging.ERROR
        if record.levelno >= floor and record.name.startswith((*self.LOGGERS, *self.SENDERS)):
            self.records.append(record)
            return False
        return True


@contextmanager
def quiet_prefect_failures() -> Iterator[HeldBack]:
    """Filter the console handlers only (the root logger's): Prefect's API handler sits on
    the run loggers themselves, so the UI keeps every record."""
    from prefect.logging.configuration import ensure_logging_setup

    ensure_logging_setup()
    held = HeldBack()
    handlers = list(logging.getLogger().handlers)
    for h in handlers:
        h.addFilter(held)
    try:
        yield held
    finally:
        for h in handlers:
            h.removeFilter(held)


def rollflow_home() -> Path:
    return Path(os.environ.get("ROLLFLOW_HOME", Path.home() / ".rollflow"))


def local_run_dir(uri: str, run_name: str) -> Path | None:
    """The run directory when it is on this machine and already exists (a run that failed
    before creating it gets no directory just for its log)."""
    if "://" in uri and not uri.startswith("file://"):
        return None
    path = Path(uri.removeprefix("file://")) / run_name
    return path if path.is_dir() else None


KEPT_LOGS = 20


def write_log(text: str, run_dir: Path | None) -> Path | None:
    """`<run dir>/logs/error-<time>.log`, else under ~/.rollflow/logs; None if neither is
    writable (the caller then prints the text). A folder keeps the last KEPT_LOGS: every
    config typo writes one, and nobody reads the hundredth."""
    name = f"error-{datetime.now():%Y%m%d-%H%M%S-%f}.log"
    for folder in ([run_dir / "logs"] if run_dir else []) + [rollflow_home() / "logs"]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text, encoding="utf-8")
        except OSError:
            continue
        for old in sorted(folder.glob("error-*.log"))[:-KEPT_LOGS]:  # names sort by time
            old.unlink(missing_ok=True)
        return folder / name
    return None


def _close_progress_bars() -> None:
    """A step's tqdm bar left open by the failure would swallow the start of our first line."""
    if "tqdm" in sys.modules:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()


def _formatted(records: list[logging.LogRecord]) -> str:
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s - %(message)s")
    return "\n".join(fmt.format(r) for r in records)


def report_failure(
    exc: BaseException,
    *,
    run_dir: Path | None = None,
    verbose: bool = False,
    held: HeldBack | None = None,
    command: list[str] | None = None,
    stream: TextIO | None = None,
) -> int:
    """Print the summary, then where the full traceback went; returns the exit code."""
    stream = stream or sys.stderr
    _close_progress_bars()
    summary = scrub(summarize(exc))
    details = scrub(strip_ansi("".join(traceback.format_exception(exc))))
    parts = [f"rollflow {' '.join(command or sys.argv[1:])}", summary, "", details]
    if held is not None and held.records:
        parts += ["Prefect's log of the failed runs:", _formatted(held.records)]
    log = write_log(scrub("\n".join(parts)), run_dir)
    print(summary, file=stream)
    if log is not None:
        print(f"  full traceback: {log}" + ("" if verbose else " (or run with --verbose)"),
              file=stream)
    if verbose or log is None:
        print(details, file=stream, end="")
    return exit_code(exc)


def run_dir_of(args: Any) -> Path | None:
    """The local run directory of a failed `train` command, for its log; None otherwise."""
    if getattr(args, "command", None) != "train":
        return None
    from flows.config.loader import load_config

    try:
        cfg = load_config(args.config, args.set)
    except Exception:  # the config itself is what failed: no run directory
        return None
    return local_run_dir(cfg.storage.uri, cfg.storage.run_name)
