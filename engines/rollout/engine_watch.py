"""Engines health-checked while a step generates, so a dead or hung one does not fail it.

```
 EngineWatch ── every interval: GET /health on each live engine, with a deadline (not
      │         /health_generate: that one queues behind the engine's running requests, so a
      │         busy engine would look hung)
      │  refused / reset      -> dead
      │  no answer in time    -> hung (SIGSTOPped, deadlocked, a stuck GPU)
      ▼
 dispatch.lose(url, why): out of the rotation (and the router's worker set); its in-flight
 requests are sent again to the engines left, which answer them exactly as the lost one
 would have (a sample's tokens depend on its seed and the weights, not on where it runs).
 The step's record names the lost engines; the generate task replaces them.
```
A request that fails in transit asks the watch to probe its engine at once (`suspect`), so a
killed engine is noticed at its first failed request, not at the next round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

log = logging.getLogger(__name__)

OnLost = Callable[[str, str], Awaitable[None]]


class EnginesLost(RuntimeError):
    """Every engine of the step was lost: nothing is left to generate on."""


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """None if the engine answered its health probe in time, else why not."""
    try:
        async with session.get(f"{url}/health",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status == 200:
                return None
            return f"unhealthy: /health answered {response.status}"
    except TimeoutError:
        return f"hung: /health did not answer in {timeout_s:g} s"
    except aiohttp.ClientError as err:
        return f"dead: {type(err).__name__}: {err}"


def refused_connection(why: str) -> bool:
    """Whether a verdict of `probe` says the engine's process is gone (its connections,
    those of requests in flight too, are refused or reset), not hung or unhealthy."""
    return why.startswith("dead:")


@dataclass
class EngineWatch:
    urls: list[str]
    interval_s: float
    hang_timeout_s: float
    on_lost: OnLost
    lost: dict[str, str] = field(default_factory=dict)  # url -> why
    _session: aiohttp.ClientSession | None = None
    _checking: dict[str, asyncio.Future[bool]] = field(default_factory=dict)

    def live(self) -> list[str]:
        return [u for u in self.urls if u not in self.lost]

    async def run(self) -> None:
        """Probe every live engine each interval until cancelled."""
        while True:
            started = time.monotonic()
            await asyncio.gather(*(self.suspect(u) for u in self.live()))
            await asyncio.sleep(max(self.interval_s - (time.monotonic() - started), 0.0))

    async def suspect(self, url: str) -> bool:
        """Probe `url` now (one probe at a time per engine); True if it is lost."""
        if url in self.lost:
            return True
        running = self._checking.get(url)
        if running is None:
            running = asyncio.ensure_future(self._check(url))
            self._checking[url] = running
            running.add_done_callback(lambda _: self._checking.pop(url, None))
        return await asyncio.shield(running)

    async def _check(self, url: str) -> bool:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        why = await probe(self._session, url, self.hang_timeout_s)
        if why is None or url in self.lost:
            return url in self.lost
        self.lost[url] = why
        log.warning("engine %s lost (%s); its requests go to %d other engine(s)", url, why,
                    len(self.live()))
        await self.on_lost(url, why)
        return True

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
