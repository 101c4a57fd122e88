"""Async mode's generation (`rollout.mode: async`): a loop that never stops between steps.

```
 data source ──draw while there is room──► in flight (<= rollout.async_inflight groups)
      ▲                                      │      ▲
      │                                      │      └── aborted by a weight push: sent again
      │                                      ▼          with its tokens, on the new version
      │                               finished: rewards, dynamic filter ──► finished queue
      │                                                                          │
      └──────── stale, `stale_groups: regenerate` ◄── step k's generate: take(k)
                                                      rollout_batch_size, due ones first
```
Step k's generate task takes `rollout_batch_size` finished groups (kept by the dynamic
filter) and writes them to rollout.arrow in the order it took them, so a replay of the step
reads exactly those. With `rollout.async_take: due_first` (the default) it takes first the
groups that are due: begun on a version step k + 1 may no longer train, so step k is the last
that may train them; it waits for those still generating, then fills up with the others in
the order they finished. A long response is then trained in the steps its draw allows, like a
short one, instead of outliving the bound. With `finish_order` it takes the first to finish.
A group with a token older than step k may train (`oldest_trainable_version`: k -
max_staleness) is regenerated from its prompt or dropped (`rollout.stale_groups`), and counted.

Room to draw (`room`): fewer than `async_inflight` groups in flight, and no more groups
outstanding (in flight and queued) than the steps that can still train a group started now
will take. A group started on version v can be trained up to step `last_trainable_step(v)`,
so with the next step to take k, outstanding groups stay under (last - k + 1) x
rollout_batch_size: if groups finish in the order they start, none goes stale (AReaL's
staleness control).

Nothing is lost across a crash, and nothing is trained twice. Each generate commit saves the
loop's snapshot as the data source's state (`snapshot`): the cursor of the draws so far, and
in the buffer every group queued or in flight, with the tokens and token versions it has
(an in-flight request's tokens as of its last answer; a weight push's abort hands them back).
A rollout actor that restarts starts the loop from the last commit's snapshot: the groups
finished or drawn since are drawn and generated again, and every group is either in one
step's rollout.arrow or in the snapshot after it. A driver that restarts finds the loop still
running in the rollout actor and takes up where it left off.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from engines.config.run import RunConfig
from engines.data.data_source import DataSourceState, RolloutDataSourceWithBuffer
from engines.rollout.generation import FINISHED, GenerationLoop, is_finished
from engines.rollout.sglang_client import SGLangClient
from engines.rollout.step_groups import GenerationStats, reset_to_prompt
from engines.weights.schedule import oldest_trainable_version
from storage.sample import Group, Sample, Status

log = logging.getLogger(__name__)

SessionFactory = Callable[[], AbstractAsyncContextManager[GenerationLoop]]
Progress = Callable[[int, int], None]
_STOP_ABORT_WAITS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def last_trainable_step(cfg: RunConfig, version: int) -> int:
    """The last step that may train a token of weight version `version` (its oldest trainable
    version is at most `version`), at most the run's last step."""
    last = cfg.rollout.num_rollout - 1
    step = version
    while step < last and (oldest_trainable_version(cfg, step + 1) or 0) <= version:
        step += 1
    return step


def room_to_draw(cfg: RunConfig, engine_version: int, next_step: int, in_flight: int,
                 queued: int) -> int:
    """Groups the loop may start now (see the module's docstring)."""
    r = cfg.rollout
    ahead = (last_trainable_step(cfg, engine_version) - next_step + 1) * r.rollout_batch_size
    return max(0, min(r.inflight_groups - in_flight, ahead - in_flight - queued))


def oldest_next_step_trains(cfg: RunConfig, rollout_id: int) -> int | None:
    """`rollout.async_take: due_first`: the oldest version step `rollout_id` + 1 may train, so
    that step `rollout_id` must take the groups begun before it (due): the finished ones
    `is_stale` for it, the in-flight ones by their `begun_on`. None (nothing is due) under
    finish_order and at the run's last step, which has no next step to leave groups to: it
    takes the first to finish rather than wait for a straggler no step needs."""
    if cfg.rollout.async_take != "due_first" or rollout_id + 1 >= cfg.rollout.num_rollout:
        return None
    return oldest_trainable_version(cfg, rollout_id + 1)


def begun_on(group: Group, engine_version: int) -> int:
    """The oldest version a token of `group`, launched now on `engine_version`, has or will
    have: the tokens it already holds (a restored or regenerated group) may be older, the ones
    still to come are not. An in-flight group is due when this is older than `oldest_next`."""
    held = [min(s.response_versions()) for s in group if s.response_length > 0]
    return min([engine_version, *held])


def due_first_ready(due: int, others: int, due_in_flight: int, count: int) -> bool:
    """`rollout.async_take: due_first`: a step holding `due` finished groups it must train and
    `others` it may, with `due_in_flight` it must train still generating, has its `count`
    groups: as many due ones as it can take, the rest from the others."""
    return due >= count or (due + others >= count and due_in_flight == 0)


def sample_is_stale(sample: Sample, oldest: int) -> bool:
    """`sample` has a response token from a version older than `oldest`."""
    return sample.response_length > 0 and min(sample.response_versions()) < oldest


def is_stale(group: Group, oldest: int | None) -> bool:
    """A sample of `group` has a token from a version older than `oldest`."""
    return oldest is not None and any(sample_is_stale(s, oldest) for s in group)


@dataclass
class Taken:
    """What one step took: its groups in the order they finished, and what the loop did
    since the last take."""

    groups: list[Group]
    waited_s: float
    stats: GenerationStats
    counts: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    queued: int = 0
    lost_engines: list[str] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {**self.stats.as_metrics(),
                "rollout/async_wait_s": self.waited_s,
                "rollout/async_in_flight": float(self.in_flight),
                "rollout/async_queued": float(self.queued),
                **{f"rollout/groups_{k}": float(v) for k, v in sorted(self.counts.items())}}


class AsyncProducer:
    """The loop, on its own thread and event loop inside the rollout actor; the actor's
    methods call `take`, `snapshot`, `put_back` and `stop`, which run on that loop."""

    def __init__(self, cfg: RunConfig, source: RolloutDataSourceWithBuffer, next_step: int,
                 open_session: SessionFactory, urls: list[str],
                 router_url: str | None = None) -> None:
        self.cfg = cfg
        self.source = source
        self.next_step = next_step
        self.urls = list(urls)
        self.router_url = router_url  # what the session sends to (None: the engines)
        self._open_session = open_session
        self._gen: GenerationLoop | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._in_flight: dict[asyncio.Task[None], Group] = {}
        self._begun_on: dict[asyncio.Task[None], int] = {}  # in flight: `begun_on`, at launch
        self._queue: list[Group] = []  # finished and kept, in finish order
        self._taking: list[Group] = []  # popped by the take under way: still outstanding
        self._draw_until: int | None = None  # the take under way's draw limit (group index)
        self._leftover: list[Group] = []  # handed back unfinished while stopping
        self._changed: asyncio.Event | None = None
        self._done: asyncio.Event | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self.engine_version = 0
        self._counts: Counter[str] = Counter()  # since the last take
        self._reported_lost: set[str] = set()  # engines named in a take already
        self._tokens_at_take = 0
        self._last_take = time.perf_counter()

    # -- the actor's side ------------------------------------------------------------------
    def start(self, engine_version: int) -> None:
        self.engine_version = engine_version
        self._thread = threading.Thread(target=self._run, name="async-rollout", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def take(self, rollout_id: int, count: int, engine_version: int,
             progress: Progress | None = None) -> Taken:
        """Step `rollout_id`'s `count` groups, waiting for them to finish."""
        return self._call(self._take(rollout_id, count, engine_version, progress))

    def snapshot(self) -> tuple[DataSourceState, list[Group]]:
        """The data source's state and buffer that hold everything the loop has: queued
        groups first (the next step takes them first), then those in flight, then what the
        source still buffers. Copies, taken between two of the loop's steps."""
        return self._call(self._snapshot())

    def put_back(self, rollout_id: int, groups: list[Group]) -> None:
        """Groups step `rollout_id` took but could not commit go back to the front of the
        queue, for its next attempt."""
        self._call(self._put_back(rollout_id, groups))

    def stop(self) -> list[Group]:
        """Abort everything in flight and end the loop; returns every group it had (queued,
        then the ones handed back unfinished). The data source holds the draws' state."""
        if self._aio is None or self._thread is None or not self._thread.is_alive():
            return []
        groups = self._call(self._stop())
        self._thread.join(timeout=60)
        return groups

    @property
    def alive(self) -> bool:
        """Running, not stopping, and no group failed."""
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self._error is None)

    def _call(self, coro: Any) -> Any:
        if self._aio is None:
            raise RuntimeError("the async rollout loop is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._aio).result()

    # -- the loop's side -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as err:  # (reported by start or the next take)
            self._error = err
            self._started.set()

    async def _main(self) -> None:
        self._aio = asyncio.get_running_loop()
        self._changed, self._done = asyncio.Event(), asyncio.Event()
        async with self._open_session() as gen:
            self._gen = gen
            watches = [asyncio.ensure_future(self._follow_versions())]
            if gen.watch is not None:
                watches.append(asyncio.ensure_future(gen.watch.run()))
            self._started.set()
            self._fill()
            try:
                await self._done.wait()
            finally:
                for watch in watches:
                    watch.cancel()
                await asyncio.gather(*watches, return_exceptions=True)

    async def _follow_versions(self, interval_s: float = 0.2) -> None:
        """While the staleness bound alone keeps the loop from drawing, ask the engines
        which version they hold: a push since the last answer makes room (the loop would
        otherwise learn of it only from a group that finishes, and none may be running)."""
        clients = [SGLangClient(url) for url in self.urls]
        try:
            while True:
                await asyncio.sleep(interval_s)
                if not self._held_by_staleness():
                    continue
                answers = await asyncio.gather(*(c.weight_version() for c in clients),
                                               return_exceptions=True)
                versions = [v for v in answers if isinstance(v, int)]
                if versions and min(versions) > self.engine_version:
                    self.engine_version = min(versions)
                    self._fill()
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))

    def _held_by_staleness(self) -> bool:
        if self._stopping or len(self._in_flight) >= self.cfg.rollout.inflight_groups:
            return False
        return self._room() == 0

    def _room(self) -> int:
        """`room_to_draw` now: groups taken by the take under way are still outstanding."""
        return room_to_draw(self.cfg, self.engine_version, self.next_step, len(self._in_flight),
                            len(self._queue) + len(self._taking))

    def _fill(self) -> None:
        """Start as many groups as there is room for."""
        if self._stopping or self._error is not None:
            return
        n = self._room()
        if self._draw_until is not None:  # (a take under way draws at most its limit)
            n = min(n, self._draw_until - self.source.state.group_index)
        if n > 0:
            for group in self.source.get_samples(n, self.next_step):
                self._launch(group)

    def _launch(self, group: Group) -> None:
        task = asyncio.ensure_future(self._generate(group))
        self._in_flight[task] = group
        self._begun_on[task] = begun_on(group, self.engine_version)

    async def _generate(self, group: Group) -> None:
        gen = self._gen
        assert gen is not None
        try:
            while True:
                before = sum(s.response_length for s in group)
                await gen.generate_group(group)
                if is_finished(group) or self._stopping:
                    break
                # Aborted mid-request (a weight push, a lost engine): go on with its tokens.
                if sum(s.response_length for s in group) == before:
                    await asyncio.sleep(0.05)  # (no token: do not spin on a paused engine)
            self._finished(group)
        except Exception as err:
            log.exception("async rollout: group %d failed", group[0].group_index)
            self._error = err
        finally:
            self._in_flight.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self._begun_on.pop(asyncio.current_task(), None)  # type: ignore[arg-type]
            self._track_version(group)
            self._fill()
            assert self._changed is not None
            self._changed.set()

    def _finished(self, group: Group) -> None:
        gen = self._gen
        assert gen is not None
        if not is_finished(group):
            self._leftover.append(group)  # (stopping)
        elif any(s.status == Status.FAILED for s in group):
            self._counts["failed"] += 1
        elif gen.dynamic_filter is not None and not gen.dynamic_filter(gen.hook_args, group):
            self._counts["dropped"] += 1
        else:
            self._queue.append(group)

    def _track_version(self, group: Group) -> None:
        self.engine_version = max([self.engine_version, *(s.weight_version for s in group
                                                            if s.response_length > 0)])

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the async rollout loop failed") from self._error

    async def _take(self, rollout_id: int, count: int, engine_version: int,
                    progress: Progress | None) -> Taken:
        assert self._changed is not None and self._gen is not None
        start = time.perf_counter()
        self.next_step = rollout_id
        self.engine_version = max(self.engine_version, engine_version)
        oldest = oldest_trainable_version(self.cfg, rollout_id)
        oldest_next = oldest_next_step_trains(self.cfg, rollout_id)
        limit = self.cfg.rollout.max_groups_per_step or 10 * count
        self._draw_until = self.source.state.group_index + limit
        due: list[Group] = []
        others: list[Group] = []  # (due ones are empty under finish_order)
        while True:
            # cleared before the queue is read: a group that finishes from here on (while the
            # progress file is written, say) wakes the wait below, even with none left in flight
            self._changed.clear()
            self._raise_if_failed()
            while self._queue and len(due) < count and (oldest_next is not None
                                                         or len(others) < count):
                group = self._queue.pop(0)
                if is_stale(group, oldest):
                    self._handle_stale(group, oldest)
                else:
                    (due if is_stale(group, oldest_next) else others).append(group)
            self._taking = due + others
            if progress is not None:
                await asyncio.to_thread(progress, min(len(due) + len(others), count), count)
            due_in_flight = (0 if oldest_next is None else
                             sum(v < oldest_next for v in self._begun_on.values()))
            if due_first_ready(len(due), len(others), due_in_flight, count):
                break
            if (self.source.state.group_index >= self._draw_until and not self._in_flight
                    and not self._queue):
                log.warning("async rollout: step %d drew %d groups and kept only %d of %d",
                            rollout_id, limit, len(due) + len(others), count)
                break
            self._fill()
            await self._changed.wait()
        taken, rest = (due + others)[:count], (due + others)[count:]
        self._queue[:0] = rest  # (back to the front, for the next step)
        self.next_step, self._taking, self._draw_until = rollout_id + 1, [], None
        self._fill()
        return self._taken(taken, time.perf_counter() - start)

    def _handle_stale(self, group: Group, oldest: int | None) -> None:
        """A queued group too old for this step: started over, or dropped (counted)."""
        if self.cfg.rollout.stale_groups == "drop":
            self._counts["stale_dropped"] += 1
            return
        for s in group:
            if oldest is not None and sample_is_stale(s, oldest):
                reset_to_prompt(s)
                self._counts["stale_regenerated_samples"] += 1
        self._launch(group)

    def _taken(self, groups: list[Group], waited: float) -> Taken:
        gen = self._gen
        assert gen is not None
        now = time.perf_counter()
        tokens = gen.tally.generated_tokens
        stats = GenerationStats(seconds=now - self._last_take,
                                generated_tokens=tokens - self._tokens_at_take)
        stats.add_groups(groups)
        lost = sorted(set(gen.watch.lost) - self._reported_lost) if gen.watch is not None else []
        self._reported_lost.update(lost)  # (the generate task replaces each one once)
        taken = Taken(groups, waited, stats, self._counts, len(self._in_flight), len(self._queue),
                      lost)
        self._counts, self._tokens_at_take, self._last_take = Counter(), tokens, now
        return taken

    async def _snapshot(self) -> tuple[DataSourceState, list[Group]]:
        groups = [*self._queue, *self._in_flight.values(), *self.source.buffer]
        return copy.copy(self.source.state), [[s.clone() for s in g] for g in groups]

    async def _put_back(self, rollout_id: int, groups: list[Group]) -> None:
        self.next_step = rollout_id
        self._queue[:0] = groups
        assert self._changed is not None
        self._changed.set()

    async def _stop(self) -> list[Group]:
        assert self._done is not None and self._gen is not None
        self._stopping = True
        self._gen.refuse_new_requests()
        waits = iter(_STOP_ABORT_WAITS)
        while self._in_flight:
            await self._gen.dispatch.abort_all()
            if self._in_flight:  # (the abort's answer may have come after the last group's)
                await asyncio.wait(list(self._in_flight),
                                   timeout=next(waits, _STOP_ABORT_WAITS[-1]))
        self._done.set()
        groups = [*self._queue, *self._leftover]
        for s in (s for g in groups for s in g if s.status not in FINISHED):
            s.status = Status.ABORTED
        return groups
