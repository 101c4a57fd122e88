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


class RoundRobinDispatch:
    """Direct to the engines: one batched request per group, engines in turn."""

    per_sample = False

    def __init__(self, clients: Sequence[Any]) -> None:
        if not clients:
            raise ValueError("the generation loop needs at least one engine")
        self.clients = list(clients)
        self.num_engines = len(self.clients)
        self._next = itertools.cycle(self.clients)

    async def generate(
        self, input_ids: list[list[int]], params: list[dict[str, Any]], rids: list[str]
    ) -> Sequence[GenerateOutput]:
        client: BatchClient = next(self._next)
        return await client.generate_batch(input_ids, params, rids=rids)

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
