"""The engine's scheduler thread: continuous batching plus SGLang's control-plane states.

    HTTP handlers --submit--> queue --(admitted between steps)--> generator.step(batch, admit)
         ^                                                               |
         +------ a submit's future, resolved when its last request ends <-+
    abort / pause / release take the step lock, so they act between two decode steps; the
    loop lets them have it before its next step (`_between_steps`).

While a batch runs, queued requests join it at the next step (a new prefill merged into
the running KV cache). When the engine is idle a short burst window lets concurrent HTTP
requests share one prefill. Paused (`in_place`, `retract`, `abort`) or released engines
accept requests and hold them until `/continue_generation` / `/resume_memory_occupation`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, TypeVar

from engines.inference.gen_types import Generator, GenRequest, GenResult, aborted_result

PAUSE_MODES = ("abort", "retract", "in_place")
_JOIN_PARTS = 8  # queued requests join a running batch an eighth of it at a time
T = TypeVar("T")
OnResult = Callable[[int, GenResult], None]
"""Called with (index in the submit, result) as each request ends."""


class _Submission:
    """The requests of one `submit` call: one future for all of their results, in order.
    A future per request, each wrapped for the server's event loop, would cost a batched
    `/generate` of 1,024 requests a fifth of its decode (bench/RESULTS.md, "Engine HTTP
    throughput").
    `record` runs under the scheduler's lock (aborts resolve from other threads), and so does
    `on_result` (a streamed answer's: it must only hand the result on)."""

    __slots__ = ("future", "results", "pending", "on_result")

    def __init__(self, size: int, on_result: OnResult | None = None) -> None:
        self.future: Future[list[GenResult]] = Future()
        self.results: list[GenResult | None] = [None] * size
        self.pending = size
        self.on_result = on_result

    def record(self, index: int, result: GenResult) -> bool:
        """Store one result; True when it was the last one."""
        self.results[index] = result
        self.pending -= 1
        if self.on_result is not None:
            self.on_result(index, result)
        return self.pending == 0

    def finish(self) -> None:
        if not self.future.done():  # done: failed by an earlier step
            self.future.set_result([r for r in self.results if r is not None])

    def fail(self, err: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(err)


class ContinuousScheduler:
    """One thread stepping one running batch of `generator`."""

    def __init__(
        self,
        generator: Generator,
        max_batch_size: int = 1024,
        batch_wait_s: float = 0.005,
        max_wait_s: float = 0.05,
    ) -> None:
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_wait_s = max_wait_s
        self._batch = generator.new_batch()
        self._queue: deque[GenRequest] = deque()
        self._waiting: dict[str, tuple[_Submission, int]] = {}  # rid -> its submit, index
        self._cond = threading.Condition()
        self._step_lock = threading.RLock()
        self._control_waiting = 0  # control calls waiting for the step lock
        self._paused: str | None = None
        self._released: set[str] = set()
        self._stop = False
        self._last_arrival = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._queue and len(self._batch) == 0

    @property
    def paused(self) -> str | None:
        return self._paused

    def can_flush(self) -> bool:
        """SGLang refuses to flush while a batch holds KV cache (or is about to)."""
        with self._cond:
            held = self._paused is not None or bool(self._released)
            return self._batch.num_running == 0 and (held or not self._queue)

    def submit(
        self, requests: list[GenRequest], on_result: OnResult | None = None
    ) -> Future[list[GenResult]]:
        """Queue requests; the future gets their results in order once the last one ends,
        `on_result` each one as it ends (a streamed answer). Raises ValueError on a request
        id already in flight."""
        with self._cond:
            rids = [r.rid for r in requests]
            dup = next((r for r in rids if r in self._waiting), None)
            if dup is not None or len(set(rids)) != len(rids):
                raise ValueError(f"Duplicate request ID: {dup or rids}")
            submission = _Submission(len(requests), on_result)
            self._waiting.update((rid, (submission, i)) for i, rid in enumerate(rids))
            self._queue.extend(requests)
            self._last_arrival = time.monotonic()
            self._cond.notify_all()
        if not requests:
            submission.future.set_result([])
        return submission.future

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """End queued and running requests now (partial output); unknown rids are ignored."""
        with self._cond:
            queued = [r for r in self._queue if abort_all or r.rid == rid]
            for r in queued:
                self._queue.remove(r)
        version = self.generator.weight_version
        self._resolve([aborted_result(r, version) for r in queued])
        with self._between_steps():
            self._resolve(self.generator.abort(self._batch, None if abort_all else [rid]))

    def pause(self, mode: str = "abort") -> None:
        """SGLang's modes: abort everything, retract (drop KV, resume later) or in place."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        with self._between_steps():
            with self._cond:
                self._paused = mode
            if mode == "abort":
                self.abort(abort_all=True)
            elif mode == "retract":
                self.generator.retract(self._batch)

    def continue_generation(self) -> None:
        with self._cond:
            self._paused = None
            self._cond.notify_all()

    def release_memory(self, tags: Collection[str]) -> None:
        with self._between_steps():
            if self._batch.num_running:
                raise RuntimeError(
                    "requests are running: pause_generation (abort or retract) before releasing"
                )
            self.generator.release_memory(tags)
            with self._cond:
                self._released |= set(tags)

    def resume_memory(self, tags: Collection[str]) -> None:
        with self._between_steps():
            self.generator.resume_memory(tags)
            with self._cond:
                self._released -= set(tags)
                self._cond.notify_all()

    @contextmanager
    def _between_steps(self) -> Iterator[None]:
        """The step lock for a control call, which the loop lets it have before its next
        step. A lock is not fair: the loop released it and took it again at once, so an
        abort waited while whole requests ran to the end (the compiled engine holds it for
        several tokens a turn, with the GIL released)."""
        with self._cond:
            self._control_waiting += 1
        try:
            with self._step_lock:
                yield
        finally:
            with self._cond:
                self._control_waiting -= 1
                self._cond.notify_all()

    def between_steps(self, work: Callable[..., T], *args: Any) -> T:
        """Run `work` (a weight update) between two steps, ahead of the next one."""
        with self._between_steps():
            return work(*args)

    def _runnable(self) -> bool:
        held = self._paused is not None or bool(self._released)
        return not held and (bool(self._queue) or len(self._batch) > 0)

    def _burst_wait(self) -> None:
        """Idle engine: let a burst of concurrent requests arrive before one prefill."""
        first = time.monotonic()
        while len(self._queue) < self.max_batch_size and not self._stop:
            quiet_until = self._last_arrival + self.batch_wait_s
            wait = min(quiet_until, first + self.max_wait_s) - time.monotonic()
            if wait <= 0:
                return
            self._cond.wait(wait)

    def _room_to_join(self) -> int:
        """Queued requests that may join the batch now. Joining a running batch merges a
        new prefill into its KV cache, copying all of it; when a step has more rows than the
        batch, rows end one by one, and a join at each end copied the cache every step
        (2,048 rows of up to 64 tokens: 29 s against 1.8 s for 1,024; bench/RESULTS.md,
        "Group journal"). So requests join a running batch once an eighth of it is free
        (or all that wait, if fewer), an idle batch at once."""
        room = max(0, self.max_batch_size - len(self._batch))
        if len(self._batch) and room < min(len(self._queue), self.max_batch_size // _JOIN_PARTS):
            return 0
        return room

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._control_waiting or not self._runnable()):
                    self._cond.wait()
                if self._stop:
                    return
                if len(self._batch) == 0:
                    self._burst_wait()
                room = self._room_to_join()
                admit = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
            with self._step_lock:
                if self._paused is not None or self._released:
                    with self._cond:
                        self._queue.extendleft(reversed(admit))
                    continue
                try:
                    results = self.generator.step(self._batch, admit)
                except Exception as err:
                    self._fail(err)
                    continue
            self._resolve(results)

    def _fail(self, err: BaseException) -> None:
        """A step raised: every request in the batch gets the error; the batch is reset."""
        with self._cond:
            queued = {r.rid for r in self._queue}
            failed = [rid for rid in self._waiting if rid not in queued]
            submissions = {sub for sub, _ in map(self._waiting.pop, failed)}  # by identity
            self._batch = self.generator.new_batch()
        for submission in submissions:
            submission.fail(err)

    def _resolve(self, results: list[GenResult]) -> None:
        complete: list[_Submission] = []
        with self._cond:
            for result in results:
                entry = self._waiting.pop(result.rid, None)
                if entry is not None and entry[0].record(entry[1], result):
                    complete.append(entry[0])
        for submission in complete:  # outside the lock: the future runs its callbacks
            submission.finish()
