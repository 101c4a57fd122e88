"""Async mode's generation loop (engines/rollout/async_producer.py) against a mock engine over
real HTTP: what it draws, what a step takes, what a snapshot holds, and the staleness bound."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from engines.config.run import RunConfig
from engines.data.data_source import RolloutDataSourceWithBuffer
from engines.inference.engine_actor import EngineActor
from engines.rollout.async_producer import (
    AsyncProducer,
    begun_on,
    is_stale,
    last_trainable_step,
    oldest_next_step_trains,
    room_to_draw,
)
from engines.rollout.generation import GenerationLoop, build_generation_loop
from engines.rollout.sglang_client import SGLangClient
from flows.config.run import EngineConfig
from storage.sample import Sample, Status
from tests.support.configs import small_config

ASYNC = ("rollout.mode=async", "rollout.num_rollout=6", "rollout.rollout_batch_size=2",
         "rollout.n_samples_per_prompt=2", "rollout.max_response_len=4", "rollout.ignore_eos=true")


def test_a_group_started_now_stays_trainable_until_the_steps_that_take_it():
    cfg = small_config(*ASYNC, "rollout.max_staleness=2")
    # version 1 may be trained by steps whose oldest trainable version (k - 2) is <= 1
    assert [last_trainable_step(cfg, v) for v in range(6)] == [2, 3, 4, 5, 5, 5]
    # engines at v1, next step 1: steps 1..3 take 3 x 2 groups; 2 in flight, 1 queued
    assert room_to_draw(cfg, 1, 1, in_flight=2, queued=1) == 2  # async_inflight 4 - 2
    assert room_to_draw(cfg, 1, 1, in_flight=1, queued=4) == 1  # 6 outstanding at most
    assert room_to_draw(cfg, 0, 3, in_flight=0, queued=0) == 0  # v0 is too old for step 3
    cfg = small_config(*ASYNC, "rollout.max_staleness=0", "train.update_weights_interval=2")
    # pushes after steps 1, 3, 5: version 0 generates steps 0 and 1
    assert last_trainable_step(cfg, 0) == 1 and room_to_draw(cfg, 0, 1, 0, 0) == 2


def test_a_group_is_due_at_the_last_step_that_may_train_it():
    cfg = small_config(*ASYNC, "rollout.max_staleness=2")  # 6 steps
    # step k leaves to step k + 1 only groups begun on version k + 1 - 2 or later
    assert [oldest_next_step_trains(cfg, k) for k in range(6)] == [0, 0, 1, 2, 3, None]
    s = Sample(index=0, group_index=0, tokens=[1, 2])
    s.append_response([5, 6], [-1.0] * 2, "", [1, 2])
    assert is_stale([s], 2) and not is_stale([s], 1) and not is_stale([s], None)  # (finished: due)
    fresh = [Sample(index=1, group_index=1, tokens=[1, 2])]  # in flight, no token yet
    assert begun_on(fresh, 1) < 2 and not begun_on(fresh, 2) < 2  # due, by its launch version
    assert begun_on([s], 3) == 1  # a restored group's own tokens count
    finish = small_config(*ASYNC, "rollout.max_staleness=2", "rollout.async_take=finish_order")
    assert {oldest_next_step_trains(finish, k) for k in range(6)} == {None}


def test_a_group_is_stale_by_its_oldest_response_token():
    s = Sample(index=0, group_index=0, tokens=[1, 2])
    s.append_response([5, 6, 7], [-1.0] * 3, "", [3, 3, 4])
    assert is_stale([s], 4) and not is_stale([s], 3) and not is_stale([s], None)
    assert not is_stale([Sample(index=1, group_index=0, tokens=[1, 2])], 9)  # no response yet


def prompts(n: int) -> list[Sample]:
    return [Sample(index=-1, group_index=-1, prompt=f"p{i}", tokens=[1, 2, 3 + i])
            for i in range(n)]


@pytest.fixture
def engine() -> Iterator[EngineActor]:
    actor = EngineActor(EngineConfig(backend="mock"), 0)
    try:
        yield actor
    finally:
        actor.shutdown()


def producer_on(engine: EngineActor, cfg: RunConfig, source: RolloutDataSourceWithBuffer,
                next_step: int = 0, dynamic_filter=None,
                hold: dict[int, threading.Event] | None = None) -> AsyncProducer:
    """`hold`: groups (by index) whose generation, once answered, does not return until the
    event is set: a long response, finished on the version it began on."""
    url = engine.url()

    @asynccontextmanager
    async def session() -> AsyncIterator[GenerationLoop]:
        async with SGLangClient(url) as client:
            loop = build_generation_loop(cfg.rollout, [client], target=None,
                                         dynamic_filter=dynamic_filter)
            generate = loop.generate_group

            async def held_generate(group: list[Sample]) -> None:
                await generate(group)
                event = (hold or {}).pop(group[0].group_index, None)
                if event is not None:
                    await asyncio.to_thread(event.wait)

            loop.generate_group = held_generate  # type: ignore[method-assign]
            yield loop

    return AsyncProducer(cfg, source, next_step, session, [url])


def test_steps_take_finished_groups_and_the_snapshot_holds_all_the_rest(engine):
    cfg = small_config(*ASYNC)
    source = RolloutDataSourceWithBuffer(prompts(40), n_samples_per_prompt=2)
    producer = producer_on(engine, cfg, source)
    producer.start(engine_version=0)
    try:
        taken = [producer.take(k, 2, engine_version=0).groups for k in (0, 1)]
        state, buffer = producer.snapshot()
    finally:
        left = producer.stop()
    assert all(len(g) == 2 and all(s.status == Status.TRUNCATED for s in g)
               for groups in taken for g in groups)
    trained = [g[0].group_index for groups in taken for g in groups]
    waiting = [g[0].group_index for g in buffer]
    # every group drawn is trained once or waits in the snapshot: none lost, none twice
    assert sorted(trained + waiting) == list(range(state.group_index))
    assert len(set(trained)) == 4
    # v0 (the engines never moved) may be trained up to step 1 with max_staleness 1: after
    # step 1 took its groups nothing more was drawn
    assert state.group_index == 4 and buffer == []
    assert left == []
    assert producer.alive is False


def test_a_step_whose_filter_keeps_nothing_draws_at_most_its_limit(engine):
    cfg = small_config(*ASYNC, "rollout.max_groups_per_step=5")
    source = RolloutDataSourceWithBuffer(prompts(40), n_samples_per_prompt=2)
    producer = producer_on(engine, cfg, source, dynamic_filter=lambda _args, _group: False)
    producer.start(engine_version=0)
    try:
        taken = producer.take(0, 2, engine_version=0)
    finally:
        producer.stop()
    # 4 drawn as the loop started (room for steps 0 and 1), then the step's limit of 5;
    # once it gave up, 2 more for step 1
    assert taken.groups == [] and taken.counts["dropped"] == 9
    assert source.state.group_index == 11


def test_groups_that_finish_while_the_progress_is_written_wake_the_take(engine):
    """The loop starts 4 groups (room for steps 0 and 1) and has room for no more until a step
    takes some. All 4 finish while step 0 writes its first progress (slow storage): the take
    must still see them. It waited for ever once: the wake-up came before it cleared its event."""
    cfg = small_config(*ASYNC)
    source = RolloutDataSourceWithBuffer(prompts(40), n_samples_per_prompt=2)
    producer = producer_on(engine, cfg, source)
    calls: list[tuple[int, int]] = []

    def slow_progress(kept: int, target: int) -> None:
        if not calls:  # the first write outlasts the 4 groups
            finished_snapshot(producer)
        calls.append((kept, target))

    producer.start(engine_version=0)
    result: list[Any] = []
    taking = threading.Thread(target=lambda: result.append(
        producer.take(0, 2, engine_version=0, progress=slow_progress)), daemon=True)
    try:
        taking.start()
        taking.join(timeout=30)
        assert result, "the take never saw the groups that finished while it wrote its progress"
    finally:
        producer.stop()
    assert len(result[0].groups) == 2 and calls[0] == (0, 2) and calls[-1] == (2, 2)


def finished_snapshot(producer: AsyncProducer) -> list[list[Sample]]:
    """The loop's snapshot once every group in it has finished."""
    deadline = time.monotonic() + 30
    while True:
        _, groups = producer.snapshot()
        if all(s.status == Status.TRUNCATED for g in groups for s in g):
            return groups
        assert time.monotonic() < deadline, "the mock engine never finished"
        time.sleep(0.01)


def test_a_stale_finished_group_is_regenerated_before_a_step_takes_it(engine):
    cfg = small_config(*ASYNC, "rollout.async_inflight=6")
    source = RolloutDataSourceWithBuffer(prompts(40), n_samples_per_prompt=2)
    producer = producer_on(engine, cfg, source)
    producer.start(engine_version=0)
    try:
        producer.take(0, 2, engine_version=0)
        queued = finished_snapshot(producer)  # step 1's two groups, finished on v0
        assert [s.weight_version for g in queued for s in g] == [0] * 4
        engine.update_weights_from_tensor({}, 3)
        step3 = producer.take(3, 2, engine_version=3)  # trains no token older than v2
        state, waiting = producer.snapshot()
    finally:
        producer.stop()
    assert all(v == 3 for g in step3.groups for s in g for v in s.response_versions())
    assert step3.counts["stale_regenerated_samples"] == 4
    # the two stale groups started over: taken by step 3, or generating again
    stale = {g[0].group_index for g in queued}
    assert stale <= {g[0].group_index for g in step3.groups + waiting}
    assert sorted(g[0].group_index for g in step3.groups + waiting) == \
        list(range(2, state.group_index))
    metrics = step3.metrics()
    assert metrics["rollout/groups_stale_regenerated_samples"] == 4.0
    assert metrics["rollout/groups"] == 2.0


@pytest.mark.parametrize("take", ["due_first", "finish_order"])
def test_a_long_group_is_trained_by_the_last_step_that_may_train_it(engine, take):
    """Group 0 begins on v0 and finishes late (a long response). With max_staleness 1, step 1
    is the last that may train v0 tokens. due_first: step 1 waits for group 0 and trains it,
    nothing is regenerated. finish_order (the guarantee off): step 1 takes groups that finished
    sooner, and group 0, finished too late, is regenerated from its prompt by step 2."""
    cfg = small_config(*ASYNC, "rollout.async_inflight=4", f"rollout.async_take={take}")
    release = threading.Event()
    producer = producer_on(engine, cfg, RolloutDataSourceWithBuffer(prompts(40), 2),
                           hold={0: release})
    producer.start(engine_version=0)
    step1: list[Any] = []
    try:
        step0 = producer.take(0, 2, engine_version=0)
        engine.update_weights_from_tensor({}, 1)
        taking = threading.Thread(target=lambda: step1.append(
            producer.take(1, 2, engine_version=1)), daemon=True)
        taking.start()
        taking.join(timeout=0.5 if take == "due_first" else 30)
        assert taking.is_alive() == (take == "due_first")  # (waiting for group 0)
        release.set()
        taking.join(timeout=30)
        engine.update_weights_from_tensor({}, 2)
        step2 = producer.take(2, 2, engine_version=2)
    finally:
        release.set()
        producer.stop()
    trained = [[g[0].group_index for g in t.groups] for t in (step0, step1[0], step2)]
    assert 0 not in trained[0]
    regenerated = sum(t.counts["stale_regenerated_samples"] for t in (step0, step1[0], step2))
    if take == "due_first":
        assert 0 in trained[1] and regenerated == 0
    else:
        assert 0 not in trained[1] and regenerated == 2  # group 0's two samples, by step 2
    assert all(v >= k - 1 for k, t in enumerate((step0, step1[0], step2))
               for g in t.groups for s in g for v in s.response_versions())


def test_a_restarted_loop_takes_up_the_snapshot(engine):
    """What a restarted rollout actor does: a new loop over a source holding the snapshot."""
    cfg = small_config(*ASYNC, "rollout.async_inflight=6")
    first = producer_on(engine, cfg, RolloutDataSourceWithBuffer(prompts(40), 2))
    first.start(engine_version=0)
    try:
        step0 = first.take(0, 2, engine_version=0).groups
        state, buffer = first.snapshot()
    finally:
        first.stop()
    waiting = [g[0].group_index for g in buffer]
    assert len(waiting) == 2  # (drawn for step 1 while step 0 took its groups)
    source = RolloutDataSourceWithBuffer(prompts(40), 2)
    source.state, source.buffer = state, buffer
    second = producer_on(engine, cfg, source, next_step=1)
    second.start(engine_version=0)
    try:
        step1 = second.take(1, 2, engine_version=0).groups
    finally:
        second.stop()
    assert [g[0].group_index for g in step1] == waiting
    assert {g[0].group_index for g in step0}.isdisjoint(g[0].group_index for g in step1)


def test_a_push_mid_request_keeps_every_token_generated(tmp_path, monkeypatch):
    """SGLang's pause (abort mode), new weights, continue: the request cut by the pause goes
    on from its tokens on the new version; none is thrown away or generated twice."""
    from examples.arithmetic.build_model import save_tiny_model
    from tests.support.engines import embedded_engine

    model = save_tiny_model(str(tmp_path / "model"), num_layers=2, hidden_size=64,
                            max_positions=512)
    cfg = small_config("rollout.mode=async", "rollout.num_rollout=2",
                       "rollout.rollout_batch_size=1", "rollout.n_samples_per_prompt=1",
                       "rollout.async_inflight=1", "rollout.max_response_len=400",
                       "rollout.ignore_eos=true", "algorithm.advantage_estimator=reinforce_plus_plus")
    with embedded_engine(model) as engine:
        # a decode step of 5 ms: the push lands mid-request, not after a 400-token answer
        step = engine.generator.step

        def slow_step(*args, **kwargs):
            time.sleep(0.005)
            return step(*args, **kwargs)

        monkeypatch.setattr(engine.generator, "step", slow_step)
        producer = producer_on(engine, cfg, RolloutDataSourceWithBuffer(prompts(4), 1))
        producer.start(engine_version=0)
        try:
            deadline = time.monotonic() + 30
            while engine.scheduler.idle:  # the request reached the engine
                assert time.monotonic() < deadline
                time.sleep(0.005)
            time.sleep(0.2)
            httpx.post(f"{engine.url()}/pause_generation", json={"mode": "abort"}).raise_for_status()
            engine.update_weights_from_tensor(engine.weights(), 1)
            httpx.post(f"{engine.url()}/continue_generation").raise_for_status()
            taken = producer.take(0, 1, engine_version=0)
        finally:
            producer.stop()
    [[sample]] = taken.groups
    versions = sample.response_versions()
    cut = versions.index(1)
    assert 0 < cut < 400 and versions == [0] * cut + [1] * (400 - cut)
    assert sample.response_length == len(sample.rollout_log_probs) == 400
    assert sample.status == Status.TRUNCATED
    assert taken.stats.generated_tokens == 400  # nothing generated twice
    assert taken.counts == {}  # nothing regenerated or dropped
