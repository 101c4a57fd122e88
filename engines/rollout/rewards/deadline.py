"""Rule grading with a per-sample deadline that holds off the main thread.

math-verify bounds its parse/verify with SIGALRM, which only a process's main thread can use.
Grading runs in the RolloutManager actor, in an asyncio loop off the main thread, where an
answer such as `\\boxed{(10^{10})!}` would run without limit and stall the whole step. So rules
that can hang run in a few worker processes: there the rule is on the worker's main thread
(math-verify's own timeouts work again), and the caller waits at most `timeout_s`.

```
 grade(rule, response, label)
   │ slot: at most `workers` in flight, so the deadline never counts time spent queueing
   ▼
 pool ──► worker (main thread: rule(response, label))
   │ in time ───────────► the reward
   │ deadline passed ───► kill every worker of the pool (a hung worker would hold its slot
   │                      for good), a new pool on the next call; None: the caller scores
   │                      the rule's failure value and counts a timeout
   │ broken by another sample's kill ──► once more, on the new pool
```
The pool starts on first use, with every worker up before any deadline runs (forkserver with
the math rules preloaded, so a replacement worker costs a fork, not a sympy import; each worker
imports the modules of the rules graded so far, so after a kill no deadline pays for importing
a rule's module such as reasoning_gym's). One pool
serves the whole process: every reward hub shares it (each eval dataset builds its own hub, and
worker processes must not multiply with them).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import multiprocessing
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

log = logging.getLogger(__name__)

TIMEOUT_FLAG = "reward_timeout"
"""`sample.metadata` key set on a sample whose grading passed its deadline (the loop counts
them as `rollout/reward_timeouts`); cleared when the sample is graded in time."""
DEFAULT_TIMEOUT_S = 10.0
# The fork server imports these once, so a worker forked from it has them (math-verify and
# sympy, which the math rules import on first use). A rule module may also define
# `prepare_worker()`: each worker calls it as it starts, before any deadline runs.
_PRELOAD = ["engines.rollout.rewards.math_rules", "math_verify"]
PREPARE_WORKER = "prepare_worker"
_STARTUP_S = 120.0  # a pool that cannot start its workers in this long is an error, not a hang


class GradingError(RuntimeError):
    pass


def _ready() -> int:
    return os.getpid()


def _init_worker(sys_path: list[str], modules: list[str]) -> None:
    # Python 3.11's forkserver does not pass the parent's sys.path on; a rule defined in the
    # user's directory (or a test module) must import in the worker as it does in the parent.
    sys.path[:] = sys_path
    for module in modules:  # before the startup check, so no deadline pays for an import
        prepare = getattr(importlib.import_module(module), PREPARE_WORKER, None)
        if callable(prepare):  # the module's own imports deferred to first use
            prepare()


def rule_module(rule: Callable[..., Any]) -> str | None:
    """The module a worker imports to unpickle `rule` (through `functools.partial`s)."""
    while isinstance(rule, functools.partial):
        rule = rule.func
    module = getattr(rule, "__module__", None)
    return module if isinstance(module, str) and module != "__main__" else None


def _context() -> multiprocessing.context.BaseContext:
    # Not fork: the actor has threads (Ray, the event loop, HTTP clients) that a fork would
    # copy mid-operation.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class GradingPool:
    """Worker processes that run rules with a deadline; thread-safe, any event loop."""

    def __init__(self, workers: int | None = None) -> None:
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.restarts = 0  # pools replaced: a rule passed its deadline or a worker died
        self._pool: ProcessPoolExecutor | None = None
        self._modules: list[str] = []  # the rules' modules: a new pool's workers import them
        self._lock = threading.Lock()  # the pool pointer and the slots
        self._start_lock = threading.Lock()  # one pool start at a time
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def _slot(self) -> asyncio.Semaphore:
        # Per event loop (asyncio primitives belong to one); the actor runs one loop at a time.
        loop = asyncio.get_running_loop()
        with self._lock:
            if loop not in self._slots:
                self._slots[loop] = asyncio.Semaphore(self.workers)
            return self._slots[loop]

    def _started(self) -> ProcessPoolExecutor:
        """The live pool, its workers started (blocking: call it in a thread)."""
        with self._start_lock:
            if self._pool is not None:
                return self._pool
            pool = ProcessPoolExecutor(
                self.workers, mp_context=_context(), initializer=_init_worker,
                initargs=(list(sys.path), list(self._modules)),
            )
            try:
                for f in [pool.submit(_ready) for _ in range(self.workers)]:
                    f.result(timeout=_STARTUP_S)
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            self._pool = pool
            return pool

    def _discard(self, pool: ProcessPoolExecutor) -> None:
        """Kill `pool`'s workers; the next call starts a new pool."""
        with self._lock:
            if self._pool is pool:
                self._pool = None
                self.restarts += 1
        _kill(pool)

    async def grade(
        self, rule: Callable[[str, str | None], Any], response: str, label: str | None,
        timeout_s: float,
    ) -> Any | None:
        """`rule(response, label)` in a worker; None when it passed `timeout_s`. A rule's own
        exception is raised here, as it would be in process."""
        loop = asyncio.get_running_loop()
        module = rule_module(rule)
        stale = None
        with self._lock:
            if module and module not in self._modules:
                self._modules.append(module)
                # a pool started before this rule's module was known would import it inside
                # the first grade's deadline (seconds on a busy machine: right answers scored
                # 0); the next pool imports it as it starts
                stale, self._pool = self._pool, None
        if stale is not None:
            _kill(stale)
        async with self._slot():
            for _ in range(2):
                pool = self._pool
                if pool is None:
                    pool = await loop.run_in_executor(None, self._started)
                try:
                    future = loop.run_in_executor(pool, rule, response, label)
                except (BrokenProcessPool, RuntimeError):  # broken or shut down since we looked
                    self._discard(pool)
                    continue
                try:
                    return await asyncio.wait_for(future, timeout_s)
                except TimeoutError:
                    if not future.cancelled():  # the rule itself raised TimeoutError
                        raise
                    self._discard(pool)
                    return None
                except BrokenProcessPool:  # killed for another sample's timeout: retry once
                    self._discard(pool)
        raise GradingError(f"grading worker died twice running {getattr(rule, '__name__', rule)}")

    @property
    def started(self) -> bool:
        return self._pool is not None

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            _kill(pool)


def _kill(pool: ProcessPoolExecutor) -> None:
    """Kill every worker (there is no public way before Python 3.14's `kill_workers`). What
    was in flight fails with BrokenProcessPool; nothing is cancelled, which would read as the
    caller's own cancellation."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=False)


SHARED_POOL = GradingPool()
"""The process's pool; it holds no process until a rule first needs one."""
