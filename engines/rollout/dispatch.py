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
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engines.rollout.sglang_client import GenerateOutput


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
        self._next = itertools.cycle(self.clients)
        self._waiting: list[_Unit] = []
        self._in_flight: set[asyncio.Future[None]] = set()  # referenced until done

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

    async def _request(self, units: list[_Unit]) -> None:
        client: BatchClient = next(self._next)
        try:
            outs = await client.generate_batch(
                [ids for u in units for ids in u.input_ids], [p for u in units for p in u.params],
                rids=[r for u in units for r in u.rids],
            )
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
        await abort_everywhere(self.clients)


class RouterDispatch:
    """Through the sglang-router: one request per sample; aborts fan out to the engines."""

    per_sample = True

    def __init__(self, router: SingleClient, engines: Sequence[AbortClient]) -> None:
        if not engines:
            raise ValueError("the router dispatch needs the engine clients (for abort_all)")
        self.router = router
        self.engines = list(engines)
        self.num_engines = len(self.engines)

    async def generate(
        self, input_ids: list[list[int]], params: list[dict[str, Any]], rids: list[str]
    ) -> Sequence[GenerateOutput]:
        (ids,), (p,), (rid,) = input_ids, params, rids
        return [await self.router.generate(ids, p, rid=rid)]

    async def abort_all(self) -> None:
        await abort_everywhere(self.engines)
