"""`rollout.rm_type: reasoning_gym` through the reward hub, graded in the grading pool's worker
processes as the rollout actor grades it: the task's own score for right, wrong and
malformed answers, a scorer past its deadline scored 0 and flagged."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engines.data.prompt_dataset import DatasetSpec, load_prompt_samples
from engines.rollout.rewards import RewardHub
from engines.rollout.rewards.deadline import TIMEOUT_FLAG, GradingPool
from engines.rollout.rewards.reasoning_gym import reasoning_gym_reward
from flows.config.run import RolloutConfig
from storage.sample import Sample

URI = "reasoning_gym://chain_sum?seed=7&size=4&min_terms=2&max_terms=2&max_digits=2"


@pytest.fixture(scope="module")
def pool() -> Iterator[GradingPool]:
    p = GradingPool(workers=1)
    yield p
    p.shutdown()


def answered(response: str) -> Sample:
    s = load_prompt_samples(DatasetSpec(URI), None).samples[0].clone()
    s.index, s.group_index, s.response = 0, 0, response
    return s


def test_the_hub_grades_with_the_tasks_scorer_in_worker_processes() -> None:
    hub = RewardHub.from_config(RolloutConfig(num_rollout=1, rollout_batch_size=1,
                                              rm_type="reasoning_gym"))
    answer = answered("").label
    assert answer is not None
    samples = [answered(f"<answer>{answer}</answer>"), answered(answer),
               answered(f"<answer>{int(answer) + 1}</answer>"), answered("<answer>"),
               answered(f"<answer>+0{answer}.00</answer>")]  # chain_sum tolerates the format
    asyncio.run(hub.assign(None, samples))
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0, 0.0, 1.0]


def slow_score(uri: str, entry: dict[str, Any], response: str, label: Any) -> float:
    """A scorer that takes `response` seconds (picklable by module path)."""
    time.sleep(float(response))
    return 1.0


def test_a_scorer_past_its_deadline_scores_zero_and_is_flagged(pool) -> None:
    reward = reasoning_gym_reward(timeout_s=0.5, pool=pool, scorer=slow_score)
    sample = answered("30")
    started = time.perf_counter()
    assert asyncio.run(reward(None, sample)) == 0.0
    assert time.perf_counter() - started < 10 and sample.metadata[TIMEOUT_FLAG] is True
    sample.response = "0"
    assert asyncio.run(reward(None, sample)) == 1.0 and TIMEOUT_FLAG not in sample.metadata
