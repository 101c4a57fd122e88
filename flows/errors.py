"""How the CLI reports a failure: the cause in one line first, the full story in a log file.

An error raised in an actor reaches the driver wrapped by Ray (`RayTaskError`, or an
`ActorDiedError` around the constructor's `RayTaskError`) and re-raised by Prefect, after
Prefect has logged every failed task and flow run with its traceback. What a user needs is
the innermost cause (`DatasetError: train.jsonl, line 3, ...`), so the CLI prints that, keeps
the tracebacks in `<run dir>/logs/error-<time>.log` (or `~/.rollflow/logs/`), and holds back
Prefect's console copies of them (the Prefect UI still gets every record).

    Prefect flow ── ActorDiedError ── RayTaskError(__init__) ── DatasetError   <- summarized
"""

from __future__ import annotations

import logging
import os
import re
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from flows.config import ConfigError
from storage.secrets import scrub

_RAY_WHERE = re.compile(r"ray::([^\s(]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def input_error_types() -> tuple[type[BaseException], ...]:
    """Failures of the user's inputs (exit code 2; anything else exits 1). Imported on
    demand: the CLI loads this module for every command, even `runs list`."""
    from engines.data.prompt_dataset import DatasetError
    from engines.hooks.loader import HookError
    from engines.rollout.rewards.hub import RewardConfigError
    from engines.train.lora import LoraResumeError

    return ConfigError, DatasetError, HookError, RewardConfigError, LoraResumeError


def _inner(exc: BaseException, stop_at: tuple[type[BaseException], ...]) -> BaseException | None:
    """The exception `exc` wraps, or None. Ray's wrappers are always opened; `__cause__` is
    followed except from an input error, whose message already says what to fix (its cause
    is a detail, e.g. the YAML parser's)."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayTaskError):  # also Ray's RayTaskError(DatasetError) dual classes
        return exc.cause if isinstance(exc.cause, BaseException) else None
    if isinstance(exc, RayActorError):  # ActorDiedError keeps the constructor's error in args
        return next((a for a in exc.args if isinstance(a, BaseException)), None)
    if isinstance(exc, stop_at):
        return None
    return exc.__cause__


def cause_chain(exc: BaseException) -> list[BaseException]:
    """`exc`, then what it wraps, down to the root cause (a `StorageError` already names the
    file and the store that failed; its cause, botocore's error, is in its message)."""
    from storage.object_store import StorageError

    stop_at = (*input_error_types(), StorageError)
    chain = [exc]
    while (inner := _inner(chain[-1], stop_at)) is not None and inner not in chain:
        chain.append(inner)
    return chain


def root_cause(exc: BaseException) -> BaseException:
    return cause_chain(exc)[-1]


def exit_code(exc: BaseException) -> int:
    return 2 if isinstance(root_cause(exc), input_error_types()) else 1


def _where(chain: list[BaseException]) -> str | None:
    """The innermost Ray task or actor method the error came out of, e.g.
    `RolloutManager.__init__` (Ray puts `ray::<name>` at the top of its messages)."""
    from ray.exceptions import RayError

    where = None
    for exc in chain:
        if isinstance(exc, RayError):
            first = _ANSI.sub("", str(exc)).split("\n", 1)[0]
            if match := _RAY_WHERE.search(first):
                # a run's named actor: `ray::<run>:<role>@<digest>:TrainActor.__init__`
                where = match.group(1).rsplit(":", 1)[-1]
    return where


def _one_line(text: str) -> str:
    """'invalid config:\\n  a: x\\n  b: y' -> 'invalid config: a: x; b: y'."""
    text = re.sub(r":\s*\n\s*", ": ", text.strip())
    return re.sub(r"\s*\n\s*", "; ", text)


def summarize(exc: BaseException, max_len: int = 400) -> str:
    """One line: the root cause's type and message, and where in Ray it was raised."""
    chain = cause_chain(exc)
    root = chain[-1]
    label, message = type(root).__name__, _ANSI.sub("", str(root)).strip()
    if "Traceback (most recent call last)" in message:
        # Ray could not rebuild the exception (e.g. UnserializableException): its text is
        # the remote traceback, whose last line is `Type: message`.
        last = message.splitlines()[-1].strip()
        label, _, message = last.partition(": ")
        label = label.rsplit(".", 1)[-1]
    line = f"{label}: {_one_line(message)}" if message else label
    for note in getattr(root, "__notes__", []):
        line += f" ({_one_line(str(note))})"
    if len(line) > max_len:
        line = line[: max_len - 3] + "..."
    where = _where(chain)
    return f"{line} (in {where})" if where else line


class HeldBack(logging.Filter):
    """Keeps Prefect's failed-run records (ERROR and up, with tracebacks) and the task
    retry warnings off the console and in memory, for the log file; the console's first
    line stays the root cause, and the UI still shows every record."""

    LOGGERS = ("prefect.flow_runs", "prefect.task_runs")

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        floor = logging.WARNING if record.name.startswith("prefect.task_runs") else logging.ERROR
        if record.levelno >= floor and record.name.startswith(self.LOGGERS):
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


def write_log(text: str, run_dir: Path | None) -> Path | None:
    """`<run dir>/logs/error-<time>.log`, else under ~/.rollflow/logs; None if neither is
    writable (the caller then prints the text)."""
    name = f"error-{datetime.now():%Y%m%d-%H%M%S-%f}.log"
    for folder in ([run_dir / "logs"] if run_dir else []) + [rollflow_home() / "logs"]:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text, encoding="utf-8")
            return folder / name
        except OSError:
            continue
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
    details = scrub(_ANSI.sub("", "".join(traceback.format_exception(exc))))
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
    from flows.config_loader import load_config

    try:
        cfg = load_config(args.config, args.set)
    except Exception:  # the config itself is what failed: no run directory
        return None
    return local_run_dir(cfg.storage.uri, cfg.storage.run_name)
