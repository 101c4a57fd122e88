"""The root cause of a failure in one line, through Ray's and Prefect's wrappers.

An error raised in an actor reaches the driver wrapped by Ray (`RayTaskError`, or an
`ActorDiedError` around the constructor's `RayTaskError`) and re-raised by Prefect, after
Prefect has logged every failed task and flow run with its traceback. The CLI's first line
and the train flow's failure notice both name the innermost cause instead:

    Prefect flow ── ActorDiedError ── RayTaskError(__init__) ── DatasetError   <- summarized
"""

from __future__ import annotations

import re

from storage.config import ConfigError

_RAY_WHERE = re.compile(r"ray::([^\s(]+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def input_error_types() -> tuple[type[BaseException], ...]:
    """Failures of the user's inputs (exit code 2; anything else exits 1). Imported on
    demand: the CLI loads this module for every command, even `runs list`."""
    from engines.data.prompt_dataset import DatasetError
    from engines.hooks.loader import HookError
    from engines.rollout.rewards.hub import RewardConfigError
    from engines.train.errors import LoraResumeError

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


def strip_ansi(text: str) -> str:
    """`text` without terminal colour codes (Ray colours the messages it prints)."""
    return _ANSI.sub("", text)
