"""Prefect artifacts sent from one background thread while a training runs.

Each artifact costs the thread that creates it a new API client and a request, a visible
share of a step's orchestration (bench/RESULTS.md, "Orchestration"), and nothing in a run
reads them back: a step's three (generation progress, step metrics, run progress) need not
wait for them. Inside
`artifacts_in_background()` they go, in order, through one worker thread that runs each in a
copy of the caller's context, so it lands on the flow or task run that made it; leaving the
block waits for them. Outside it (a unit test calling a task's `.fn`, a one-off evaluation)
`send_artifact` sends at once.

A failed artifact is logged, not raised: a progress bar the API refused must not fail a
training step. The run directory, not the UI, is the record (metrics.json, curves.png).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

logger = logging.getLogger(__name__)

# How long leaving the block waits for artifacts still queued (an API that stopped answering
# would otherwise hold the end of a run for Prefect's client retries, artifact by artifact).
DRAIN_TIMEOUT_S = 60.0


class ArtifactSender:
    """One worker thread sending artifacts in the order they were submitted."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollflow-artifacts")
        self._pending: list[Future[None]] = []

    def submit(self, send: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        context = contextvars.copy_context()  # the flow/task run the artifact belongs to
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(context.run, _logged, send, *args, **kwargs))

    def close(self, timeout: float = DRAIN_TIMEOUT_S) -> int:
        """Wait for queued artifacts (up to `timeout` s); return how many were dropped."""
        _, late = wait(self._pending, timeout=timeout)
        self._pool.shutdown(wait=not late, cancel_futures=True)
        if late:
            logger.warning("%d Prefect artifact(s) not sent within %.0f s; dropped",
                           len(late), timeout)
        return len(late)


def _logged(send: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        send(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - reported, never raised: see the module docstring
        logger.warning("Prefect artifact not sent (%s): %s", getattr(send, "__name__", send), e)


_CURRENT: contextvars.ContextVar[ArtifactSender | None] = contextvars.ContextVar(
    "rollflow_artifact_sender", default=None)


@contextmanager
def artifacts_in_background(timeout: float = DRAIN_TIMEOUT_S) -> Iterator[ArtifactSender]:
    """Within: `send_artifact` queues; on leaving, the queue is drained (see the module doc)."""
    sender = ArtifactSender()
    token = _CURRENT.set(sender)
    try:
        yield sender
    finally:
        _CURRENT.reset(token)
        sender.close(timeout)


def send_artifact(send: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """`send(*args, **kwargs)` (a Prefect `create_*_artifact` call or similar): queued inside
    `artifacts_in_background()`, run now outside it."""
    sender = _CURRENT.get()
    if sender is None:
        send(*args, **kwargs)
    else:
        sender.submit(send, *args, **kwargs)
