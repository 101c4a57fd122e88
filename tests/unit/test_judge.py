"""The LLM judge (`rm_type: judge`, engines/rollout/rewards/judge.py): score parsing, template
filling, the cache, the concurrency cap, retries and each `on_failure` mode, against a real
OpenAI-shaped HTTP server on 127.0.0.1 (the judge served by `rollflow engine`:
tests/integration/test_judge_engine.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import ValidationError

from engines.config.judge import DEFAULT_SCORE_PATTERN, DEFAULT_TEMPLATE, JudgeConfig
from engines.rollout.rewards import RewardConfigError, RewardHub
from engines.rollout.rewards.judge import (
    JUDGE_ERROR,
    JUDGE_RETRIES,
    JudgeConfigError,
    JudgeError,
    JudgeReward,
    ScoreCache,
    UnparsedAnswer,
    fill_template,
    parse_score,
    prompt_text,
)
from engines.rollout.step_groups import GenerationStats, LoopTally
from flows.config.run import RolloutConfig
from storage.sample import Sample
from tests.support.fakes import JudgeServer
from tests.support.fakes import judge_grade as grade


@pytest.fixture()
def judge_server() -> Iterator[Callable[..., JudgeServer]]:
    servers: list[JudgeServer] = []

    def make(**kw: Any) -> JudgeServer:
        servers.append(JudgeServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def judge(server: JudgeServer, **kw: Any) -> JudgeReward:
    settings: dict[str, Any] = {"template": "{response}", "backoff_s": 0.01, **kw}
    return JudgeReward.from_config(JudgeConfig(base_url=server.base_url, model="j", **settings))


def sample(response: str, i: int = 0, label: str | None = None, **meta: Any) -> Sample:
    return Sample(index=i, group_index=0, prompt="q", response=response, label=label,
                  metadata=meta)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# -- parsing and filling -------------------------------------------------------------------
def test_parse_score_takes_the_score_line_else_the_last_number() -> None:
    def default(answer: str) -> float:
        return parse_score(answer, DEFAULT_SCORE_PATTERN, 0.0, 10.0)

    assert default("Score: 7") == 0.7
    assert default("It has 3 errors.\n**Score:** 8/10") == 0.8  # the score line, not 3 or 10
    assert default("Score: 2 at first; on reflection Score: 9.5") == 0.95  # the last one
    assert default("I would give it a 6") == 0.6  # no score line: the last number
    assert default("Score: 0") == 0.0 and default("score = 10") == 1.0
    assert parse_score("Verdict 3", r"Verdict (\d)", 1.0, 5.0) == 0.5  # scaled from [1, 5]


@pytest.mark.parametrize("answer, reason", [
    ("Score: 11", r"score 11 is outside \[0, 10\]"),
    ("Score: -1", r"score -1 is outside"),
    ("I cannot grade this.", "no score in the answer"),
    ("", "no score in the answer"),
])
def test_parse_score_refuses_an_answer_without_a_score_in_range(answer: str, reason: str) -> None:
    with pytest.raises(UnparsedAnswer, match=reason):
        parse_score(answer, DEFAULT_SCORE_PATTERN, 0.0, 10.0)


def test_template_fills_each_placeholder_once_and_keeps_other_braces() -> None:
    template = 'Q: {prompt}\nRef: {label}\nA: {response}\nAnswer as {"score": N}, {prompt}'
    got = fill_template(template, "2+2?", "it is {label}", "4")
    # A response that contains a placeholder is quoted, not filled (a one-pass fill).
    assert got == 'Q: 2+2?\nRef: 4\nA: it is {label}\nAnswer as {"score": N}, 2+2?'
    assert fill_template("[{label}] {response}", "p", "r", None) == "[] r"
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    assert prompt_text(chat) == "system: be brief\nuser: 2+2?"
    assert all("{" + k + "}" in DEFAULT_TEMPLATE for k in ("prompt", "response", "label"))


def test_config_checks_name_the_key_and_redact_the_url() -> None:
    ok = {"base_url": "https://u:hunter2@judge.example/v1", "model": "m"}
    assert "hunter2" not in json.dumps(JudgeConfig(**ok).model_dump())
    rollout = RolloutConfig(num_rollout=1, rollout_batch_size=1, judge=ok)
    assert "hunter2" not in json.dumps(rollout.model_dump())
    bad: list[tuple[dict[str, Any], str]] = [
        ({"template": "grade {prompt}"}, "rollout.judge.template: has no {response}"),
        ({"score_pattern": r"\d+"}, "needs a group"),
        ({"score_pattern": "(unclosed"}, "not a regex"),
        ({"max_score": 0.0}, r"max_score \(0\) must be above"),
        ({"api": "completions", "system_prompt": "x"}, "needs rollout.judge.api: chat")]
    for extra, message in bad:
        with pytest.raises(ValidationError, match=message):
            JudgeConfig(**ok, **extra)


# -- requests, cache, concurrency ----------------------------------------------------------
def test_chat_and_completion_requests_carry_the_filled_template_and_the_key(
        judge_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server = judge_server(answer=lambda text: f"Score: {len(text)}")
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    chat = judge(server, template="{prompt}/{label}/{response}", system_prompt="grade",
                 api_key_env="JUDGE_TEST_KEY", max_tokens=7)
    assert run(chat.score(None, sample("3", label="4"))) == len("q/4/3") / 10
    body = server.requests[-1]
    assert body["path"] == "/v1/chat/completions" and server.auth[-1] == "Bearer sk-test"
    assert body["messages"] == [{"role": "system", "content": "grade"},
                                {"role": "user", "content": "q/4/3"}]
    assert (body["model"], body["max_tokens"], body["temperature"]) == ("j", 7, 0.0)
    completions = judge(server, api="completions")
    assert run(completions.score(None, sample("123456"))) == 0.6
    assert server.requests[-1]["path"] == "/v1/completions"
    assert server.requests[-1]["prompt"] == "123456" and server.auth[-1] is None
    monkeypatch.delenv("JUDGE_TEST_KEY")
    with pytest.raises(JudgeConfigError, match=r"\$JUDGE_TEST_KEY is not set"):
        judge(server, api_key_env="JUDGE_TEST_KEY")


def test_cache_answers_a_repeated_request_at_temperature_zero_only(judge_server: Any) -> None:
    server = judge_server()
    greedy = judge(server)
    first, repeat, other = sample("8", i=0), sample("8", i=1), sample("5", i=2)
    assert run(greedy.score(None, first)) == 0.8
    assert run(greedy.score(None, repeat)) == 0.8
    assert len(server.requests) == 1 and greedy.cache.hits == 1
    assert run(greedy.score(None, other)) == 0.5 and len(server.requests) == 2
    sampled = judge(server, temperature=0.7)  # each request a fresh draw: nothing cached
    for s in (first, repeat):
        assert run(sampled.score(None, s)) == 0.8
    assert len(server.requests) == 4 and len(sampled.cache) == 0


def test_score_cache_drops_the_least_recently_used() -> None:
    cache = ScoreCache(2)
    cache.put("a", 0.1)
    cache.put("b", 0.2)
    assert cache.get("a") == 0.1  # a is now the most recent
    cache.put("c", 0.3)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (0.1, None, 0.3)


def test_requests_in_flight_are_capped_by_max_concurrency(judge_server: Any) -> None:
    # each answer takes 0.6 s, so the second request arrives while the first is held even
    # on a loaded machine (at 0.2 s this failed once in the unit tier beside another worker;
    # the output was not kept, and the likely cause is a second request that came too late)
    server = judge_server(delay_s=0.6)
    capped = judge(server, max_concurrency=2)

    async def score_all() -> list[float]:
        return list(await asyncio.gather(
            *(capped.score(None, sample(str(i), i=i)) for i in range(6))))

    assert run(score_all()) == [i / 10 for i in range(6)]
    assert server.max_in_flight == 2  # concurrent, but never more than the cap


# -- retries and failures ------------------------------------------------------------------
def test_a_busy_judge_is_retried_with_backoff_until_it_answers(judge_server: Any) -> None:
    server = judge_server(fail_first=2, fail_status=503)
    start = time.perf_counter()
    s = sample("9", i=4)
    assert run(judge(server, backoff_s=0.05).score(None, s)) == 0.9
    assert len(server.requests) == 3 and JUDGE_ERROR not in s.metadata
    assert time.perf_counter() - start >= 0.05 + 0.1  # backoff 0.05, then 0.1
    assert s.metadata[JUDGE_RETRIES] == 2  # counted per step: rollout/judge_retries
    tally = LoopTally()
    tally.judged([s, sample("1", i=5)])
    metrics = GenerationStats.of([[s]], tally, seconds=1.0).as_metrics()
    assert metrics["rollout/judge_retries"] == 2.0


@pytest.mark.parametrize("mode", ["retry_then_fail", "fail", "zero"])
def test_an_unreachable_judge_after_retries_by_mode(judge_server: Any, mode: str) -> None:
    server = judge_server(fail_first=100, fail_status=500)
    reward, s = judge(server, max_retries=2, on_failure=mode), sample("7", i=7)
    if mode == "zero":
        assert run(reward.score(None, s)) == 0.0
        assert s.metadata[JUDGE_ERROR].startswith("failed: no answer after 3 attempt(s)")
    else:
        with pytest.raises(JudgeError, match=rf"{server.base_url}/chat/completions.*sample 7: "
                                             r"failed: no answer after 3 attempt\(s\).*HTTP 500"):
            run(reward.score(None, s))
    assert len(server.requests) == 3  # retried in every mode


@pytest.mark.parametrize("mode, asked", [("retry_then_fail", 3), ("fail", 1), ("zero", 1)])
def test_an_unparsed_answer_by_mode(judge_server: Any, mode: str, asked: int) -> None:
    rambling = "I am not sure how to grade this. " * 20  # 660 characters, no number
    server = judge_server(answer=lambda text: rambling)
    reward, s = judge(server, max_retries=2, on_failure=mode), sample("7", i=7)
    if mode == "zero":
        assert run(reward.score(None, s)) == 0.0
        assert s.metadata[JUDGE_ERROR].startswith("unparsed: no score in the answer")
    else:
        with pytest.raises(JudgeError) as err:
            run(reward.score(None, s))
        message = str(err.value)
        assert "sample 7: unparsed: no score in the answer" in message
        assert repr(rambling[:200]) in message and rambling[:201] not in message
    assert len(server.requests) == asked
    assert len(reward.cache) == 0  # a failure is never cached


def test_a_zero_score_is_flagged_counted_and_cleared_on_success(judge_server: Any) -> None:
    server = judge_server(answer=lambda text: "Score: 99" if text == "x" else grade(text))
    reward = judge(server, on_failure="zero")
    group = [sample("x", i=0), sample("4", i=1), sample("x", i=2)]
    assert [run(reward.score(None, s)) for s in group] == [0.0, 0.4, 0.0]
    assert [s.metadata.get(JUDGE_ERROR, "")[:8] for s in group] == ["unparsed", "", "unparsed"]
    tally = LoopTally()
    tally.judged(group)
    metrics = GenerationStats.of([group], tally, seconds=1.0).as_metrics()
    assert (metrics["rollout/judge_unparsed"], metrics["rollout/judge_failures"]) == (2.0, 0.0)
    group[0].response = "1"  # scored again, and this time judged: the flag goes
    assert run(reward.score(None, group[0])) == 0.1 and JUDGE_ERROR not in group[0].metadata


def test_a_refused_request_fails_in_every_mode_other_4xx_are_not_retried(
        judge_server: Any) -> None:
    unauthorized = judge_server(fail_first=100, fail_status=401)
    with pytest.raises(JudgeError, match="refuses the request itself, HTTP 401"):
        run(judge(unauthorized, on_failure="zero").score(None, sample("1")))
    assert len(unauthorized.requests) == 1
    too_long = judge_server(fail_first=100, fail_status=400)
    s = sample("1", i=3)
    assert run(judge(too_long, on_failure="zero").score(None, s)) == 0.0
    assert s.metadata[JUDGE_ERROR].startswith("failed: HTTP 400")
    assert len(too_long.requests) == 1


# -- the reward hub ------------------------------------------------------------------------
def test_judge_is_selected_by_rm_type_and_by_sample_metadata(judge_server: Any) -> None:
    server = judge_server()
    judge_cfg = {"base_url": server.base_url, "model": "j", "template": "{response}"}

    def hub(**kw: Any) -> RewardHub:
        return RewardHub.from_config(RolloutConfig(num_rollout=1, rollout_batch_size=1, **kw))

    assert run(hub(rm_type="judge", judge=judge_cfg).score(None, sample("3"))) == 0.3
    mixed = hub(rm_type="exact_match", judge=judge_cfg)
    assert run(mixed.score(None, sample("6", label="7"))) == 0.0  # exact_match: 6 != 7
    assert run(mixed.score(None, sample("6", label="7", rm_type="judge"))) == 0.6
    assert len(server.requests) == 2
    with pytest.raises(RewardConfigError, match="rollout.rm_type: judge needs rollout.judge"):
        hub(rm_type="judge")
    with pytest.raises(RewardConfigError, match=r"sample 5 .*judge needs rollout.judge"):
        run(hub(rm_type="exact_match").score(None, sample("1", i=5, rm_type="judge")))
