"""Rule grading with a deadline, off the main thread (as in the RolloutManager actor): a rule
that hangs scores as a failure in about the deadline and is counted; the worker pool is replaced
and keeps grading right; samples in flight when it is killed are graded again, not lost."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest

from engines.rollout.generation import build_generation_loop
from engines.rollout.rewards import (
    RewardHub,
    dapo_score,
    exact_match_score,
    f1_score,
    last_number_score,
    math_score,
    rule_reward,
)
from engines.rollout.rewards.deadline import TIMEOUT_FLAG, GradingPool
from flows.config.run import RolloutConfig
from storage.sample import Group, Sample, Status

T = TypeVar("T")
HANG = r"so \boxed{(10^{10})!}"  # sympy evaluates the factorial; math-verify's SIGALRM cannot stop it here


def spin(response: str, label: str | None) -> float:
    """A rule that never returns (picklable by module path, as the built-ins are)."""
    while True:
        pass


def slow_one(response: str, label: str | None) -> float:
    time.sleep(float(response))
    return 1.0


def off_main_thread(make: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine in an event loop on a worker thread, where SIGALRM cannot be used."""
    out: dict[str, Any] = {}

    def target() -> None:
        assert threading.current_thread() is not threading.main_thread()
        try:
            out["value"] = asyncio.run(make())  # type: ignore[arg-type]
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            out["error"] = e

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "grading hung past its deadline"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.fixture(scope="module")
def pool() -> Iterator[GradingPool]:
    p = GradingPool(workers=2)
    yield p
    p.shutdown()


def sample(response: str, label: str | None, i: int = 0) -> Sample:
    return Sample(index=i, group_index=0, prompt="q", response=response, label=label)


def test_math_grading_through_the_pool_gives_right_answers(pool: GradingPool) -> None:
    math, dapo = rule_reward(math_score, pool=pool), rule_reward(dapo_score, pool=pool)
    cases = [
        (math, sample(r"The answer is \boxed{\frac{1}{2}}", "0.5"), 1.0),
        (math, sample(r"\boxed{0.51}", "0.5"), 0.0),
        (math, sample(r"\boxed{3}", r"solution ... \boxed{3}"), 1.0),
        (dapo, sample("work\nAnswer: 12", "12"), {"score": 1.0, "acc": 1.0}),
        (dapo, sample("Answer: 13", "12"), {"score": -1.0, "acc": 0.0}),
    ]

    async def grade() -> list[Any]:
        return list(await asyncio.gather(*(fn(None, s) for fn, s, _ in cases)))

    assert off_main_thread(grade) == [want for _, _, want in cases]
    assert not any(TIMEOUT_FLAG in s.metadata for _, s, _ in cases)


def test_hanging_answer_fails_at_the_deadline_and_is_counted(pool: GradingPool) -> None:
    hub = RewardHub(rule_reward(math_score, timeout_s=1.0, pool=pool))
    cfg = RolloutConfig(num_rollout=1, rollout_batch_size=1)
    never_called = [object()]  # every sample is finished: the loop only scores them
    group: Group = [sample(HANG, "1", 0), sample(r"\boxed{2}", "2", 1), sample(HANG, "1", 2)]
    for s in group:
        s.status = Status.COMPLETED
    restarts = pool.restarts
    start = time.monotonic()
    _, stats = off_main_thread(lambda: build_generation_loop(cfg, never_called, hub).run([group]))
    assert time.monotonic() - start < 6.0  # two 1 s deadlines in a row at most
    assert [s.reward for s in group] == [0.0, 1.0, 0.0]
    assert [bool(s.metadata.get(TIMEOUT_FLAG)) for s in group] == [True, False, True]
    assert stats.as_metrics()["rollout/reward_timeouts"] == 2.0
    assert pool.restarts > restarts
    # Grading goes on, on a fresh pool; a sample graded in time loses its flag.
    group[0].response = r"\boxed{1}"
    _, stats = off_main_thread(
        lambda: build_generation_loop(cfg, never_called, hub).run([group[:1]]))
    assert group[0].reward == 1.0 and TIMEOUT_FLAG not in group[0].metadata
    assert stats.reward_timeouts == 0


def test_dapo_timeout_scores_dapo_failure(pool: GradingPool) -> None:
    reward = rule_reward(dapo_score, timeout_s=0.5, pool=pool)
    s = sample("Answer: " + HANG, "1")
    assert off_main_thread(lambda: reward(None, s)) == {"score": -1.0, "acc": 0.0}
    assert s.metadata[TIMEOUT_FLAG] is True


def test_samples_in_flight_survive_another_samples_kill(pool: GradingPool) -> None:
    """A spinning rule is killed at 1 s while a legitimate one (1.5 s) is running in the
    other worker: that one is graded again on the new pool, and scores right."""

    async def both() -> list[Any]:
        return list(await asyncio.gather(
            pool.grade(spin, "", None, 1.0), pool.grade(slow_one, "1.5", None, 5.0)
        ))

    restarts = pool.restarts
    assert off_main_thread(both) == [None, 1.0]
    assert pool.restarts == restarts + 1


def test_cheap_rules_stay_in_process() -> None:
    untouched = GradingPool(workers=1)
    for rule in (exact_match_score, f1_score, last_number_score):
        reward = rule_reward(rule, boxed=True, timeout_s=1.0, pool=untouched)
        assert asyncio.run(reward(None, sample(r"\boxed{7}", "7"))) == 1.0
    assert not untouched.started


def test_rule_timeout_is_configured_and_positive() -> None:
    assert RolloutConfig(num_rollout=1, rollout_batch_size=1).rm_rule_timeout_s == 10.0
    with pytest.raises(ValueError, match="rm_rule_timeout_s"):
        RolloutConfig(num_rollout=1, rollout_batch_size=1, rm_rule_timeout_s=0)


def test_a_rules_module_is_imported_before_its_deadline_starts() -> None:
    """The rule's module takes 2 s to import and the deadline is 1 s: a worker that imported it
    inside the deadline would score a timeout, on a new pool as on the first."""
    from tests.support.slow_import_rule import IMPORT_S, quick

    fresh = GradingPool(workers=1)
    try:
        for _ in range(2):
            assert off_main_thread(lambda: fresh.grade(quick, "", None, IMPORT_S / 2)) == 1.0
            fresh._discard(fresh._pool)  # a kill, as after another rule's timeout
        assert fresh.restarts == 2
    finally:
        fresh.shutdown()


def test_a_rules_deferred_set_up_runs_as_the_worker_starts() -> None:
    """The rule takes 2 s on first use unless its module's `prepare_worker()` ran, and the
    deadline is 1 s: the pool's workers call it as they start, on a new pool as on the first
    (without the call, every pool's first grade times out)."""
    from tests.support.slow_import_rule import IMPORT_S, quick_once_prepared

    fresh = GradingPool(workers=1)
    try:
        for _ in range(2):
            assert off_main_thread(
                lambda: fresh.grade(quick_once_prepared, "", None, IMPORT_S / 2)) == 1.0
            fresh._discard(fresh._pool)
    finally:
        fresh.shutdown()
