"""Prefect artifacts published off the step's critical path.

Each artifact is an API round trip to a single-process server (15-40 ms, more while the
server is busy recording task states), and a step used to wait for three of them: the
generation progress bar, the step's metrics table and the train run's progress bar. They are
for people, so they go through one background thread instead, in the order they were asked
for (a progress artifact is created before it is updated, table versions stay in order),
each in the context of the flow or task run that asked for it (so it lands on that run's
page even if the run has finished by then). `drain()` waits for them: the train flow calls
it before it returns, so a finished training has all its artifacts. A failed publication is
logged, never raised: a lost progress bar must not fail a training.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from uuid import UUID

log = logging.getLogger(__name__)

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pending: list[Future[None]] = []


def _run_logged(context: contextvars.Context, fn: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> None:
    try:
        context.run(fn, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - an artifact is for people; see the docstring
        log.warning("could not publish a Prefect artifact (%s): %s", getattr(fn, "__name__", fn), e)


def later(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Call `fn(*args, **kwargs)` on the artifact thread, in the caller's context."""
    global _pool
    context = contextvars.copy_context()
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollflow-artifacts")
        _pending[:] = [f for f in _pending if not f.done()]
        _pending.append(_pool.submit(_run_logged, context, fn, args, kwargs))


def drain(timeout: float | None = 60.0) -> None:
    """Wait until every artifact asked for so far is published (or failed and logged)."""
    with _lock:
        waiting = list(_pending)
    for future in waiting:
        try:
            future.result(timeout=timeout)
        except TimeoutError:
            log.warning("Prefect artifacts still unpublished after %.0f s; not waiting", timeout)
            return


atexit.register(drain, 10.0)


class ProgressArtifact:
    """A Prefect progress artifact that is created by its first `set` and updated by the
    later ones, all on the artifact thread (the id it gets back stays there)."""

    def __init__(self, key: str, description: str) -> None:
        self.key, self.description = key, description
        self._id: UUID | None = None
        self._last: float | None = None

    def set(self, percent: float) -> None:
        """Show `percent`; the same value twice in a row is sent once."""
        if percent != self._last:
            self._last = percent
            later(self._publish, percent)

    def _publish(self, percent: float) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        if self._id is None:
            self._id = create_progress_artifact(percent, key=self.key,  # type: ignore[assignment]
                                                description=self.description)
        else:
            update_progress_artifact(self._id, percent)
