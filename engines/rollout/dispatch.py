"""How the generation loop reaches the engines: through the router, or round-robin.

The sglang-router (0.3.x) takes one `sampling_params` object and one string `rid` per request,
while every sample needs its own seed and (after a partial rollout) its own token budget, so
through the router each sample is its own request; the router's cache-aware policy keeps a
group's shared prompt on one engine. Without the router a group is one batched request to the
next engine. Either way `/abort_request` goes to every engine directly: the router does not
forward it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engines.rollout.engine_watch import EnginesLost
from engines.rollout.sglang_client import GenerateOutput, SGLangError, TransportError

# `suspect(url)`: probe an engine a request just failed on; True if it is lost (EngineWatch)
Suspect = Callable[[str], Awaitable[bool]]
_ROUTER_RETRIES = 3  # a request the router failed, sent again (while the watch probes)


class BatchClient(Protocol):
    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        rids: list[str] | None = None,
        return_logprob: bool = True,
    ) -> Sequence[GenerateOutput]: ...


class SingleClient(Protocol):
    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateOutput: ...


class AbortClient(Protocol):
    async def abort_all(self) -> None: ...


@runtime_checkable
class Dispatch(Protocol):
    """One unit of work = one HTTP request; `per_sample` says whether a unit is a sample or a
    whole group."""

    num_engines: int
    per_sample: bool

    async def generate(
        self, input_ids: list[list[int]], params: list[dict[str, Any]], rids: list[str]
    ) -> Sequence[GenerateOutput]: ...

    async def abort_all(self) -> None: ...


@runtime_checkable
class Healing(Protocol):
    """A dispatch that can go on without an engine (both built-in ones can)."""

    suspect: Suspect | None
    resent_samples: int

    async def lose(self, url: str) -> None:
        """Take a dead or hung engine out; its in-flight requests go to the others."""
        ...


async def _abort_quietly(client: Any, timeout_s: float = 5.0) -> None:
    """Best effort: a dead engine refuses it, a hung one never answers."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.abort_all(), timeout_s)


def _url(client: Any) -> str:
    """How the watch names an engine: its client's base URL."""
    return str(getattr(client, "base_url", id(client)))


async def abort_everywhere(clients: Sequence[AbortClient]) -> None:
    await asyncio.gather(*(c.abort_all() for c in clients))


@dataclass(slots=True)
class _Unit:
    """One caller's rows, waiting to share a request, and where its outputs go."""

    input_ids: list[list[int]]
    params: list[dict[str, Any]]
    rids: list[str]
    done: asyncio.Future[Sequence[GenerateOutput]]


class RoundRobinDispatch:
    """Direct to the engines, in turn. Groups sent in the same turn of the event loop share
    one batched request while it holds at most `max_request_samples` samples: a step's
    groups all start together, and one request saves the HTTP and JSON of each of the
    others and the prefills of those that would reach the engine after the first
    (bench/RESULTS.md, "vs TRL", one request per step). Each sample keeps its own rid, seed
    and budget, so aborts and outputs stay per sample; a group's result arrives with its
    request's. The default, 1, is a request per group."""

    per_sample = False

    def __init__(self, clients: Sequence[Any], max_request_samples: int = 1) -> None:
        if not clients:
            raise ValueError("the generation loop needs at least one engine")
        self.clients = list(clients)
        self.num_engines = len(self.clients)
        self.max_request_samples = max_request_samples
        self.live = list(self.clients)
        self._turn = 0
        self._waiting: list[_Unit] = []
        self._in_flight: set[asyncio.Future[None]] = set()  # referenced until done
        self._attempts: dict[str, set[asyncio.Future[Any]]] = {}  # by engine URL
        self.suspect: Suspect | None = None  # set by the step's EngineWatch
        self.resent_samples = 0

    async def generate(
        self, input_ids: list[list[int]], params: list[dict[str, Any]], rids: list[str]
    ) -> Sequence[GenerateOutput]:
        loop = asyncio.get_running_loop()
        if not self._waiting:
            loop.call_soon(self._send_waiting)  # after every caller of this turn has queued
        unit = _Unit(input_ids, params, rids, loop.create_future())
        self._waiting.append(unit)
        return await unit.done

    def _send_waiting(self) -> None:
        units, self._waiting = self._waiting, []
        batches: list[list[_Unit]] = []
        size = 0
        for unit in units:
            if not batches or size + len(unit.rids) > self.max_request_samples:
                batches.append([])
                size = 0
            batches[-1].append(unit)
            size += len(unit.rids)
        for batch in batches:
            request = asyncio.ensure_future(self._request(batch))
            self._in_flight.add(request)
            request.add_done_callback(self._in_flight.discard)

    def _pick(self) -> Any:
        if not self.live:
            raise EnginesLost("every engine of the step was lost")
        client = self.live[self._turn % len(self.live)]
        self._turn += 1
        return client

    async def _send_once(self, units: list[_Unit]) -> Sequence[GenerateOutput]:
        """The request on the next live engine, sent again elsewhere if that engine is lost
        meanwhile (cancelled by `lose`) or fails in transit and a probe finds it lost."""
        while True:
            client = self._pick()
            url = _url(client)
            attempt = asyncio.ensure_future(client.generate_batch(
                [ids for u in units for ids in u.input_ids], [p for u in units for p in u.params],
                rids=[r for u in units for r in u.rids],
            ))
            self._attempts.setdefault(url, set()).add(attempt)
            try:
                return await attempt
            except asyncio.CancelledError:
                if client in self.live or not attempt.cancelled():
                    raise  # the caller was cancelled, not the engine lost
            except TransportError:
                if self.suspect is None or not await self.suspect(url):
                    raise
            finally:
                self._attempts[url].discard(attempt)
            self.resent_samples += sum(len(u.rids) for u in units)

    async def lose(self, url: str) -> None:
        lost = [c for c in self.live if _url(c) == url]
        self.live = [c for c in self.live if _url(c) != url]
        for attempt in list(self._attempts.get(url, ())):
            attempt.cancel()
        for client in lost:  # if it was only slow, it must not go on with what was resent
            abort = asyncio.ensure_future(_abort_quietly(client))
            self._in_flight.add(abort)
            abort.add_done_callback(self._in_flight.discard)

    async def _request(self, units: list[_Unit]) -> None:
        try:
            outs = await self._send_once(units)
        except BaseException as e:  # every caller sees the request's failure
            for u in units:
                if not u.done.done():
                    u.done.set_exception(e)
            if not isinstance(e, Exception):
                raise
            return
        start = 0
        for u in units:
            if not u.done.done():  # a caller that was cancelled meanwhile
                u.done.set_result(outs[start : start + len(u.rids)])
            start += len(u.rids)

    async def abort_all(self) -> None:
        await abort_everywhere(self.live)


class RouterDispatch:
    """Through the sglang-router: one request per sample; aborts fan out to the engines."""

    per_sample = True

    def __init__(
        self, router: SingleClient, engines: Sequence[AbortClient],
        remove_worker: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        if not engines:
            raise ValueError("the router dispatch needs the engine clients (for abort_all)")
        self.router = router
        self.engines = list(engines)
        self.num_engines = len(self.engines)
        self.remove_worker = remove_worker  # takes a lost engine out of the router
        self._attempts: set[asyncio.Future[Any]] = set()
        self._losses = 0
        self.suspect: Suspect | None = None
        self.resent_samples = 0

    async def generate(
        self, input_ids: list[list[int]], params: list[dict[str, Any]], rids: list[str]
    ) -> Sequence[GenerateOutput]:
        """One sample through the router. The router does not say which engine served a
        request, so when one is lost every request in flight is sent again (under a new
        rid), and one the router failed is retried while the watch may still be finding
        the engine that failed it."""
        (ids,), (p,), (rid,) = input_ids, params, rids
        sent, failures = 0, 0
        while True:
            losses = self._losses
            attempt = asyncio.ensure_future(
                self.router.generate(ids, p, rid=rid if sent == 0 else f"{rid}-resent{sent}"))
            self._attempts.add(attempt)
            try:
                return [await attempt]
            except asyncio.CancelledError:
                if self._losses == losses or not attempt.cancelled():
                    raise
            except (*TransportError, SGLangError) as err:
                failures += 1
                if self.suspect is None or failures > _ROUTER_RETRIES or (
                        isinstance(err, SGLangError) and err.status_code < 500):
                    raise
                await asyncio.sleep(0.1 * 2**failures)
            finally:
                self._attempts.discard(attempt)
            sent += 1
            self.resent_samples += 1

    async def lose(self, url: str) -> None:
        self.engines = [e for e in self.engines if getattr(e, "base_url", None) != url]
        if not self.engines:
            raise EnginesLost("every engine of the step was lost")
        if self.remove_worker is not None:
            await self.remove_worker(url)
        self._losses += 1
        for attempt in list(self._attempts):
            attempt.cancel()

    async def abort_all(self) -> None:
        await abort_everywhere(self.engines)
