"""The LLM judge (`rm_type: judge`) served by `rollflow engine`, another model behind the
OpenAI API as in a judge-rewarded run: samples scored end to end through the reward hub, and
a judge outage in the middle of scoring (the engine stopped, then restarted on the same port)
ridden out by retries, as the remote reward model's is (tests/unit/test_judge.py: the rest).

The judge is the example's tiny random model (through /v1/completions: its chat answers
vary less), so its answers are characters; the first digit of an answer is its score (0-9)
and an answer without one is unparsed. What each sample should
get is asked of the same engine directly, with a request written out here (greedy decoding, one
request at a time, so the judge's requests see the same batches)."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from engines.rollout.rewards import RewardHub
from engines.rollout.rewards.judge import JUDGE_ERROR, UNPARSED, judge_error_kind
from examples.arithmetic.build_model import save_tiny_model
from flows.config.run import RolloutConfig
from storage.sample import Sample
from tests.support.engines import EngineCommand as Engine
from tests.support.engines import engine_command

TEMPLATE = "q: {prompt} a: {response}. score 0-9:"
MAX_TOKENS = 16
MODEL = "judge"  # tests.support.engines.EngineCommand serves it by this name


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(save_tiny_model(str(tmp_path_factory.mktemp("judge") / "tiny")))


@pytest.fixture()
def judge_engine(tiny_model: Path, tmp_path: Path) -> Iterator[Engine]:
    with engine_command(tiny_model, tmp_path / "engine.log") as engine:
        yield engine


def candidates() -> list[Sample]:
    return [Sample(index=i, group_index=i, prompt=f"{i}+{i}?", response=str(2 * i + i % 2),
                   label=str(2 * i)) for i in range(12)]


def expected(engine: Engine, s: Sample) -> float | None:
    """The reward the judge should give `s` (None: its answer holds no digit)."""
    digit = re.search(r"\d", engine.answer(TEMPLATE.format(prompt=s.prompt, response=s.response)))
    return None if digit is None else int(digit.group()) / 9


def hub(engine: Engine, **judge: Any) -> RewardHub:
    settings = {"base_url": engine.base_url, "model": MODEL, "api": "completions",
                "template": TEMPLATE, "score_pattern": r"(\d)", "max_score": 9,
                "max_tokens": MAX_TOKENS, "max_concurrency": 1, **judge}
    return RewardHub.from_config(RolloutConfig(num_rollout=1, rollout_batch_size=1,
                                               rm_type="judge", judge=settings))


def test_the_judge_scores_samples_through_rollflow_engine(judge_engine: Engine) -> None:
    samples = candidates()
    want = [expected(judge_engine, s) for s in samples]
    assert None in want and len({w for w in want if w is not None}) >= 2, (
        f"the tiny judge's answers no longer give both outcomes: {want}")
    asyncio.run(hub(judge_engine, on_failure="zero").assign(None, samples))
    assert [s.reward for s in samples] == [0.0 if w is None else w for w in want]
    assert [judge_error_kind(s.metadata) for s in samples] == [
        UNPARSED if w is None else None for w in want]
    unparsed = next(s for s, w in zip(samples, want, strict=True) if w is None)
    assert "no score in the answer; answer: " in unparsed.metadata[JUDGE_ERROR]


def retried(caplog: pytest.LogCaptureFixture) -> bool:
    return any(r.name == "engines.rollout.rewards.judge" and "attempt 1)" in r.getMessage()
               for r in caplog.records)


def test_a_judge_outage_mid_scoring_is_ridden_out_by_retries(
        judge_engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="engines.rollout.rewards.judge")
    parsed = [s for s in candidates() if expected(judge_engine, s) is not None]
    before, during = parsed[:2], parsed[2:4]
    assert len(during) == 2, "the tiny judge parses fewer than 4 of the candidates"
    rewards = hub(judge_engine, max_retries=12, backoff_s=0.25)  # retry_then_fail
    asyncio.run(rewards.assign(None, before))

    judge_engine.stop()
    pool = ThreadPoolExecutor(1)
    try:
        scoring = pool.submit(asyncio.run, rewards.assign(None, during))
        deadline = time.monotonic() + 30
        while not retried(caplog):  # a request refused by the stopped engine, to be retried
            assert time.monotonic() < deadline and not scoring.done(), caplog.text
            time.sleep(0.1)
        again = [Sample(index=100 + s.index, group_index=0, prompt=s.prompt,
                        response=s.response) for s in before]
        asyncio.run(rewards.assign(None, again))  # the cache answers while the judge is down
        assert [s.reward for s in again] == [s.reward for s in before]
        assert not scoring.done()
    finally:
        judge_engine.start()  # on the same port, while the reward is retrying
        pool.shutdown(wait=False)
    scoring.result(timeout=150)

    assert [s.reward for s in during] == [expected(judge_engine, s) for s in during]
    assert [s.reward for s in before] == [expected(judge_engine, s) for s in before]
    assert not any(JUDGE_ERROR in s.metadata for s in [*before, *during])
