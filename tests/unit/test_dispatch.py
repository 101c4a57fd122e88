"""Direct dispatch: groups that start together share requests, each sample keeps its own."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from engines.rollout.dispatch import RoundRobinDispatch
from engines.rollout.sglang_client import GenerateOutput


class RecordingEngine:
    """The engine edge: records each /generate request's rids and answers each row with its
    own seed as the output token (so a mixed-up row would show)."""

    def __init__(self, fail: bool = False) -> None:
        self.requests: list[list[str]] = []
        self.fail = fail

    async def generate_batch(
        self, input_ids: list[list[int]], sampling_params: Any, rids: list[str] | None = None,
        return_logprob: bool = True,
    ) -> list[GenerateOutput]:
        assert rids is not None and len(rids) == len(input_ids) == len(sampling_params)
        self.requests.append(list(rids))
        await asyncio.sleep(0.01)
        if self.fail:
            raise ConnectionError("engine unreachable")
        return [GenerateOutput([p["sampling_seed"]], "", [-0.5], {"type": "length"}, 3)
                for p in sampling_params]

    async def generate_batch_stream(
        self, input_ids: list[list[int]], sampling_params: Any, rids: list[str] | None = None,
        return_logprob: bool = True,
    ) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """The rows last to first (a stream's rows end in any order)."""
        outs = await self.generate_batch(input_ids, sampling_params, rids, return_logprob)
        for row in reversed(range(len(outs))):
            yield row, outs[row]


def group_call(dispatch: RoundRobinDispatch, g: int, size: int) -> Any:
    seeds = [100 * g + j for j in range(size)]
    return dispatch.generate([[1, 2, g]] * size, [{"sampling_seed": s} for s in seeds],
                             [f"sample-{s}" for s in seeds])


async def _groups(dispatch: RoundRobinDispatch, sizes: list[int]) -> list[Any]:
    return await asyncio.gather(*(group_call(dispatch, g, n) for g, n in enumerate(sizes)))


def test_groups_that_start_together_share_requests_up_to_the_cap() -> None:
    engines = [RecordingEngine(), RecordingEngine()]
    outs = asyncio.run(_groups(RoundRobinDispatch(engines, max_request_samples=16), [8] * 5))
    # 40 samples in requests of at most 16 (whole groups), engines in turn
    assert [len(r) for r in engines[0].requests + engines[1].requests] == [16, 8, 16]
    assert engines[0].requests[0] == [f"sample-{100 * g + j}" for g in (0, 1) for j in range(8)]
    for g, out in enumerate(outs):  # each caller gets its own rows back, in its order
        assert [o.output_ids[0] for o in out] == [100 * g + j for j in range(8)]


def test_one_sample_per_request_sends_each_group_alone() -> None:
    engine = RecordingEngine()
    asyncio.run(_groups(RoundRobinDispatch([engine], max_request_samples=1), [4, 4, 4]))
    assert [len(r) for r in engine.requests] == [4, 4, 4]
    # a group larger than the cap still travels whole
    engine.requests.clear()
    asyncio.run(_groups(RoundRobinDispatch([engine], max_request_samples=3), [4, 2, 1]))
    assert [len(r) for r in engine.requests] == [4, 3]


def test_a_group_sent_later_gets_its_own_request() -> None:
    engine = RecordingEngine()
    dispatch = RoundRobinDispatch([engine], max_request_samples=1024)

    async def staggered() -> None:
        first = asyncio.ensure_future(_groups(dispatch, [2, 2]))
        while not engine.requests:  # until the first two are on their way
            await asyncio.sleep(0)
        await asyncio.gather(first, group_call(dispatch, 7, 2))

    asyncio.run(staggered())
    assert [len(r) for r in engine.requests] == [4, 2]


def test_a_failed_request_fails_every_group_in_it() -> None:
    dispatch = RoundRobinDispatch([RecordingEngine(fail=True)], max_request_samples=1024)

    async def run() -> list[Any]:
        return await asyncio.gather(*(group_call(dispatch, g, 2) for g in range(3)),
                                    return_exceptions=True)

    results = asyncio.run(run())
    assert [type(r) for r in results] == [ConnectionError] * 3
    with pytest.raises(ConnectionError):
        asyncio.run(_groups(dispatch, [2]))


def test_groups_share_requests_only_when_every_group_must_finish() -> None:
    from engines.config.rollout import RolloutConfig
    from engines.rollout.generation import request_cap

    cfg = RolloutConfig(num_rollout=1, rollout_batch_size=4, max_request_samples=512)
    assert request_cap(cfg, filtered=False, target=4) == 512
    # a dynamic filter or over-sampling lets the step abort stragglers: a request per group
    assert request_cap(cfg, filtered=True, target=4) == 1
    over = RolloutConfig(num_rollout=1, rollout_batch_size=4, over_sampling_batch_size=6,
                         max_request_samples=512)
    assert request_cap(over, filtered=False, target=4) == 1


@pytest.mark.parametrize("filtered", [False, True])
def test_a_loop_on_plain_clients_shares_requests_only_when_it_cannot_abort(filtered: bool) -> None:
    """A GenerationLoop given plain engine clients (a custom rollout function's way) decides
    request sharing in run_dynamic as the rollout manager does: a step that may abort
    stragglers sends a request per group, so one slow sample cannot hold back the others."""
    from engines.config.rollout import RolloutConfig
    from engines.data.data_source import RolloutDataSourceWithBuffer
    from engines.rollout.generation import build_generation_loop
    from storage.sample import Sample

    cfg = RolloutConfig(num_rollout=1, rollout_batch_size=3, n_samples_per_prompt=2,
                        max_response_len=1, max_request_samples=512)
    prompts = [Sample(index=-1, group_index=-1, prompt=f"p{i}", tokens=[1, 2, 3 + i])
               for i in range(10)]
    source = RolloutDataSourceWithBuffer(prompts, n_samples_per_prompt=2)
    engine = RecordingEngine()
    keep_all = (lambda _args, _group: True) if filtered else None
    loop = build_generation_loop(cfg, [engine], target=3, dynamic_filter=keep_all)
    result = asyncio.run(loop.run_dynamic(source))
    assert len(result.kept) == 3
    assert [len(r) for r in engine.requests] == ([2, 2, 2] if filtered else [6])


class HangingEngine(RecordingEngine):
    """A SIGSTOPped engine: takes requests and never answers."""

    base_url = "http://hung"

    async def generate_batch(self, input_ids: Any, sampling_params: Any, rids: Any = None,
                             return_logprob: bool = True) -> list[GenerateOutput]:
        self.requests.append(list(rids or []))
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def test_a_lost_engine_s_requests_go_to_the_engine_left() -> None:
    async def go() -> tuple[list[Any], HangingEngine, RecordingEngine, RoundRobinDispatch]:
        hung, alive = HangingEngine(), RecordingEngine()
        alive.base_url = "http://alive"  # type: ignore[attr-defined]
        dispatch = RoundRobinDispatch([alive, hung], max_request_samples=1)
        sent = [asyncio.ensure_future(dispatch.generate([[1]], [{"sampling_seed": i}],
                                                        [f"s{i}"])) for i in range(4)]
        await asyncio.sleep(0.05)
        assert all(not f.done() for f in sent[1::2])  # those on the hung engine wait
        await dispatch.lose("http://hung")
        outs = await asyncio.gather(*sent)
        return outs, hung, alive, dispatch
    outs, hung, alive, dispatch = asyncio.run(go())
    assert [o[0].output_ids for o in outs] == [[0], [1], [2], [3]]
    assert dispatch.resent_samples == len(hung.requests) == 2
    assert sorted(r for req in alive.requests for r in req) == ["s0", "s1", "s2", "s3"]
    # the two resent requests made one token each; every request was answered by `alive`
    assert dispatch.resent_tokens == 2 and dict(dispatch.served) == {"http://alive": 4}


class RefusingEngine(RecordingEngine):
    """A killed engine: the connection is refused."""

    base_url = "http://killed"

    async def generate_batch(self, input_ids: Any, sampling_params: Any, rids: Any = None,
                             return_logprob: bool = True) -> list[GenerateOutput]:
        self.requests.append(list(rids or []))
        raise aiohttp.ClientConnectionError("Connection refused")


@pytest.mark.parametrize("found_lost", [True, False])
def test_a_request_that_fails_in_transit_is_resent_if_a_probe_finds_its_engine_lost(
    found_lost: bool,
) -> None:
    async def go() -> Any:
        killed, alive = RefusingEngine(), RecordingEngine()
        alive.base_url = "http://alive"  # type: ignore[attr-defined]
        dispatch = RoundRobinDispatch([killed, alive], max_request_samples=1)
        probed: list[str] = []

        async def suspect(url: str) -> bool:
            probed.append(url)
            if found_lost:
                await dispatch.lose(url)
            return found_lost
        dispatch.suspect = suspect
        outs = await dispatch.generate([[1]], [{"sampling_seed": 9}], ["s9"])
        return outs, probed, alive
    if found_lost:
        outs, probed, alive = asyncio.run(go())
        assert outs[0].output_ids == [9] and probed == ["http://killed"]
        assert alive.requests == [["s9"]]
    else:  # the engine answers its probe: the request's own error stands
        with pytest.raises(aiohttp.ClientConnectionError):
            asyncio.run(go())


def test_losing_every_engine_fails_the_request() -> None:
    from engines.rollout.engine_watch import EnginesLost

    async def go() -> Any:
        dispatch = RoundRobinDispatch([HangingEngine()], max_request_samples=1)
        sent = asyncio.ensure_future(dispatch.generate([[1]], [{"sampling_seed": 1}], ["s1"]))
        await asyncio.sleep(0.02)
        await dispatch.lose("http://hung")
        return await sent
    with pytest.raises(EnginesLost):
        asyncio.run(go())


class StreamingEngine:
    """Answers each row `delays[seed]` seconds after the request came, as a stream; rows
    whose delay is None never end (an engine that hangs mid-request)."""

    def __init__(self, delays: dict[int, float | None], url: str) -> None:
        self.delays, self.base_url = delays, url
        self.requests: list[list[str]] = []

    async def generate_batch_stream(
        self, input_ids: Any, sampling_params: Any, rids: Any = None, return_logprob: bool = True,
    ) -> AsyncIterator[tuple[int, GenerateOutput]]:
        self.requests.append(list(rids))
        seeds = [p["sampling_seed"] for p in sampling_params]
        ends = [self.delays.get(s, 0.0) for s in seeds]
        waited = 0.0
        for row in sorted(range(len(seeds)), key=lambda r: float("inf") if ends[r] is None
                          else ends[r]):
            end = ends[row]
            if end is None:
                await asyncio.Event().wait()  # hangs
                return
            await asyncio.sleep(end - waited)
            waited = end
            yield row, GenerateOutput([seeds[row]], "", [-0.5], {"type": "stop"}, 3)

    async def abort_all(self) -> None:
        pass


def test_a_group_arrives_when_its_own_rows_end_not_with_the_request() -> None:
    async def go() -> None:
        engine = StreamingEngine({0: 0.0, 1: 0.0, 100: 0.5, 101: 0.5}, "http://e")
        dispatch = RoundRobinDispatch([engine], max_request_samples=16)
        fast, slow = (asyncio.ensure_future(group_call(dispatch, g, 2)) for g in (0, 1))
        await asyncio.sleep(0.2)
        assert fast.done() and not slow.done()  # one request, two moments
        assert [o.output_ids[0] for o in fast.result()] == [0, 1]
        assert [o.output_ids[0] for o in await slow] == [100, 101]
        assert engine.requests == [["sample-0", "sample-1", "sample-100", "sample-101"]]
    asyncio.run(go())


def test_only_the_groups_a_lost_engine_had_not_answered_are_resent() -> None:
    async def go() -> None:
        # group 0's rows end, then the engine hangs on group 1's
        hung = StreamingEngine({0: 0.0, 1: 0.0, 100: None, 101: None}, "http://hung")
        alive = StreamingEngine({}, "http://alive")
        dispatch = RoundRobinDispatch([hung, alive], max_request_samples=16)
        first, second = (asyncio.ensure_future(group_call(dispatch, g, 2)) for g in (0, 1))
        await asyncio.sleep(0.1)
        assert first.done() and not second.done()
        await dispatch.lose("http://hung")
        assert [o.output_ids[0] for o in await second] == [100, 101]
        assert alive.requests == [["sample-100", "sample-101"]]
        assert dispatch.resent_samples == 2 and dispatch.resent_tokens == 2
    asyncio.run(go())


class FakeRouter:
    """The sglang-router in front of engines `a` and `b`, round-robin, its own retries off:
    a request on an engine that dies fails with HTTP 500 and the engine's dead URL refuses
    every later one; a request on a hung engine never answers. Records which engine got
    each rid; every request ends `release` after it came, unless its engine died or hung."""

    def __init__(self) -> None:
        self.workers = ["http://a", "http://b"]
        self.state = {"http://a": "up", "http://b": "up"}
        self.turn = 0
        self.got: dict[str, list[str]] = {"http://a": [], "http://b": []}
        self.release = asyncio.Event()
        self.died = {url: asyncio.Event() for url in self.workers}

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any],
                       rid: str | None = None, return_logprob: bool = True) -> GenerateOutput:
        from engines.rollout.sglang_client import SGLangError

        url = self.workers[self.turn % len(self.workers)]
        self.turn += 1
        self.got[url].append(str(rid))
        if self.state[url] == "dead":
            raise SGLangError(500, "connection refused", "/generate")
        await asyncio.wait({asyncio.ensure_future(self.release.wait()),
                            asyncio.ensure_future(self.died[url].wait())},
                           return_when=asyncio.FIRST_COMPLETED)
        if self.state[url] == "dead":
            raise SGLangError(500, "connection reset by peer", "/generate")
        if self.state[url] == "hung":
            await asyncio.Event().wait()
        return GenerateOutput([sampling_params["sampling_seed"]], "", [-0.5],
                              {"type": "length"}, 3)


class Engine:
    def __init__(self, url: str) -> None:
        self.base_url = url

    async def abort_all(self) -> None:
        pass


@pytest.mark.parametrize("fault", ["dead", "hung"])
def test_through_the_router_only_a_dead_engine_s_requests_are_sent_again(fault: str) -> None:
    """8 samples in flight, 4 on each engine; engine a is lost. Dead: its 4 fail and only
    they are sent again (to b), after the probe took a out of the router; b's 4 are never
    cancelled. Hung: nothing fails, so every request in flight is sent again."""
    from engines.rollout.dispatch import RouterDispatch

    async def go() -> tuple[list[Any], FakeRouter, RouterDispatch]:
        router = FakeRouter()
        dispatch = RouterDispatch(router, [Engine("http://a"), Engine("http://b")])

        async def remove_worker(url: str) -> None:
            router.workers.remove(url)
        dispatch.remove_worker = remove_worker

        async def suspect(url: str) -> bool:  # the watch's probe
            if router.state[url] != "up" and url in router.workers:
                why = "dead: ClientConnectorError" if fault == "dead" else "hung: no answer"
                await dispatch.lose(url, why)
            return router.state[url] != "up"
        dispatch.suspect = suspect
        sent = [asyncio.ensure_future(dispatch.generate([[1]], [{"sampling_seed": i}],
                                                        [f"s{i}"])) for i in range(8)]
        await asyncio.sleep(0.05)
        router.state["http://a"] = fault
        router.died["http://a"].set()
        if fault == "hung":
            await asyncio.sleep(0.05)
            await suspect("http://a")  # the watch's round finds it
        await asyncio.sleep(0.05)
        router.release.set()
        return await asyncio.gather(*sent), router, dispatch

    outs, router, dispatch = asyncio.run(go())
    assert [o[0].output_ids for o in outs] == [[i] for i in range(8)]
    assert router.got["http://a"] == ["s0", "s2", "s4", "s6"]  # round-robin: the engine that was lost
    resent_to_b = [r for r in router.got["http://b"] if "-resent" in r]
    if fault == "dead":
        assert sorted(resent_to_b) == ["s0-resent1", "s2-resent1", "s4-resent1", "s6-resent1"]
        assert dispatch.resent_samples == 4 == dispatch.resent_tokens
    else:
        assert len(resent_to_b) == 8 and dispatch.resent_samples == 8
