"""The reward hub: rule rewards with math-verify, boxed_, per-sample rm_type, custom and group
reward hooks, and remote_rm against a real local HTTP server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from engines.hooks.loader import HookError
from engines.rollout.rewards import (
    RemoteRewardError,
    RewardConfigError,
    RewardHub,
    dapo_score,
    deepscaler_score,
    f1_score,
    last_boxed,
    math_score,
)
from flows.config.run import RolloutConfig
from storage.sample import Sample
from tests.support.fakes import RewardServer


def cfg(**kw: Any) -> RolloutConfig:
    return RolloutConfig(num_rollout=1, rollout_batch_size=1, **kw)


def sample(response: str, label: str | None, i: int = 0, **meta: Any) -> Sample:
    return Sample(index=i, group_index=0, prompt="q", response=response, label=label, metadata=meta)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_last_boxed_balances_braces_and_takes_the_last() -> None:
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}} done") == r"\frac{1}{2}"
    assert last_boxed(r"\fbox{x^{2}}") == "x^{2}"
    assert last_boxed(r"so $\boxed 7$") == "7"
    assert last_boxed(r"\boxed{unclosed") is None
    assert last_boxed("no box") is None


def test_math_uses_symbolic_equivalence() -> None:
    assert math_score(r"The answer is \boxed{\frac{1}{2}}", "0.5") == 1.0
    assert math_score(r"\boxed{\frac{2}{4}}", r"\frac{1}{2}") == 1.0
    assert math_score(r"\boxed{0.51}", "0.5") == 0.0
    assert math_score("42", "42") == 1.0  # no box: the whole response is the answer
    assert math_score(r"\boxed{3}", r"solution ... \boxed{3}") == 1.0  # boxed label
    assert math_score(r"\boxed{3}", None) == 0.0


def test_deepscaler_needs_closed_thinking_and_a_box() -> None:
    assert deepscaler_score(r"<think>\boxed{2}</think> so \boxed{4}", "4") == 1.0
    assert deepscaler_score(r"<think>\boxed{4}</think> so \boxed{2}", "4") == 0.0
    assert deepscaler_score(r"\boxed{4}", "4") == 0.0  # never closed its thinking
    assert deepscaler_score(r"<think>x</think> 4", "4") == 0.0  # no box


def test_dapo_scores_plus_minus_one_on_the_answer_line() -> None:
    assert dapo_score("work...\nAnswer: 12", "12") == {"score": 1.0, "acc": 1.0}
    assert dapo_score("Answer: 11\nAnswer: 12", "12")["score"] == 1.0  # the last one counts
    assert dapo_score("Answer: 13", "12") == {"score": -1.0, "acc": 0.0}
    assert dapo_score("12", "12")["score"] == -1.0  # no Answer: line


def test_f1_is_squad_token_f1() -> None:
    assert f1_score("The Eiffel Tower!", "eiffel tower") == 1.0
    # pred tokens {paris, france, city}, gold {paris}: P = 1/3, R = 1 -> F1 = 0.5
    assert f1_score("Paris, France city", "Paris") == pytest.approx(0.5)
    assert f1_score("yes it is", "no") == 0.0
    assert f1_score("", "x") == 0.0


def test_hub_dispatch_rm_type_boxed_and_metadata_override() -> None:
    hub = RewardHub.from_config(cfg(rm_type="boxed_exact_match"))
    assert run(hub.score(None, sample(r"think 9 \boxed{ 12 }", "12"))) == 1.0
    assert run(hub.score(None, sample("12", "12"))) == 0.0  # no box -> ""
    override = sample("the cat sat", "cat sat", rm_type="f1")
    # pred {cat, sat} after dropping "the": exact F1 = 1
    assert run(hub.score(None, override)) == 1.0
    with pytest.raises(RewardConfigError, match=r"sample 3 .*metadata.rm_type.*'nope'"):
        run(hub.score(None, sample("x", "x", i=3, rm_type="nope")))
    with pytest.raises(RewardConfigError, match="rollout.rm_type: unknown reward 'bogus'"):
        RewardHub.from_config(cfg(rm_type="bogus"))
    with pytest.raises(RewardConfigError, match="rollout.rm_type: remote_rm needs rollout.rm_url"):
        RewardHub.from_config(cfg(rm_type="remote_rm"))


# Hooks loaded by import string from this module.
CALLS: list[int] = []


async def length_reward(args: Any, s: Sample) -> dict[str, float]:
    return {"len": float(len(s.response)), "one": 1.0}


async def rank_group(args: Any, samples: list[Sample]) -> list[float]:
    CALLS.append(len(samples))
    order = sorted(range(len(samples)), key=lambda i: len(samples[i].response))
    ranks = [0.0] * len(samples)
    for rank, i in enumerate(order):
        ranks[i] = float(rank)
    return ranks


def sync_reward(args: Any, s: Sample) -> float:
    return 0.0


def test_custom_rm_and_group_rm_by_import_string() -> None:
    hub = RewardHub.from_config(cfg(custom_rm_path=f"{__name__}:length_reward"))
    rewards = run(hub.score_group(None, [sample("abc", None), sample("a", None)]))
    assert rewards == [{"len": 3.0, "one": 1.0}, {"len": 1.0, "one": 1.0}]

    CALLS.clear()
    group_hub = RewardHub.from_config(cfg(custom_rm_path=f"{__name__}.rank_group", group_rm=True))
    group = [sample("xxx", None, 0), sample("x", None, 1), sample("xx", None, 2)]
    run(group_hub.assign(None, group))
    assert [s.reward for s in group] == [2.0, 0.0, 1.0] and CALLS == [3]  # one batched call

    with pytest.raises(HookError, match="rollout.custom_rm_path: .*async def"):
        RewardHub.from_config(cfg(custom_rm_path=f"{__name__}:sync_reward"))
    with pytest.raises(HookError, match="rollout.custom_rm_path: .*cannot take 2"):
        RewardHub.from_config(cfg(custom_rm_path=f"{__name__}:rank_group_missing"))
    with pytest.raises(RewardConfigError, match="rollout.group_rm: needs rollout.custom_rm_path"):
        RewardHub.from_config(cfg(rm_type="f1", group_rm=True))


async def rank_group_missing(args: Any) -> float:
    return 0.0


async def one_reward_for_the_group(args: Any, samples: list[Sample]) -> float:
    return 1.0


def test_a_group_reward_that_is_not_a_list_is_a_hook_error() -> None:
    hub = RewardHub.from_config(
        cfg(custom_rm_path=f"{__name__}:one_reward_for_the_group", group_rm=True))
    with pytest.raises(HookError, match=rf"^rollout.custom_rm_path: {__name__}:"
                       r"one_reward_for_the_group returned float 1.0, expected a list of one "
                       r"reward per sample"):
        run(hub.assign(None, [sample("a", None, 0), sample("b", None, 1)]))


async def buggy_reward(args: Any, s: Sample) -> float:
    return float(s.response)  # ValueError on a non-number: a bug in the user's code


async def unreachable_reward(args: Any, s: Sample) -> float:
    raise ConnectionError("reward service briefly unreachable")


def test_a_custom_reward_that_raises_is_a_hook_error_that_is_not_retried() -> None:
    from prefect.states import Failed

    from tasks.retries import retry_transient

    hub = RewardHub.from_config(cfg(custom_rm_path=f"{__name__}.buggy_reward"))
    bad = sample("seven", None, 4, source_line=5, source_file="train.jsonl")
    with pytest.raises(HookError) as raised:
        run(hub.assign(None, [sample("7", None, 3), bad]))
    assert str(raised.value) == (
        f"rollout.custom_rm_path: {__name__}:buggy_reward failed on sample 4 (prompt line 5 "
        "of train.jsonl): ValueError: could not convert string to float: 'seven'")
    assert isinstance(raised.value.__cause__, ValueError)
    assert retry_transient(None, None, Failed(data=raised.value)) is False

    # I/O that may work next time is not the hook's bug: it stays itself and is retried.
    flaky = RewardHub.from_config(cfg(custom_rm_path=f"{__name__}:unreachable_reward"))
    with pytest.raises(ConnectionError) as transient:
        run(flaky.assign(None, [sample("7", None, 3)]))
    assert retry_transient(None, None, Failed(data=transient.value)) is True


@pytest.fixture()
def server_factory() -> Iterator[Any]:
    servers: list[RewardServer] = []

    def make(**kw: Any) -> RewardServer:
        servers.append(RewardServer(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def remote_hub(url: str, **kw: Any) -> RewardHub:
    return RewardHub.from_config(
        cfg(rm_type="remote_rm", rm_url=url, rm_backoff_s=0.01, reward_key="score", **kw)
    )


def test_remote_rm_posts_the_sample_and_retries_5xx(server_factory: Any) -> None:
    srv = server_factory(fail_first=2, fail_status=503)
    s = sample("hello", "lbl", i=7, topic="t")
    start = time.perf_counter()
    assert run(remote_hub(srv.url).score(None, s)) == {"score": 5.0, "ok": 1.0}
    assert len(srv.requests) == 3  # two 503s, then success
    assert srv.requests[0] == {"prompt": "q", "response": "hello", "label": "lbl", "metadata": {"topic": "t"}}
    assert time.perf_counter() - start >= 0.01 + 0.02  # backoff 0.01 then 0.02


def test_remote_rm_fails_fast_on_4xx_and_gives_up_after_retries(server_factory: Any) -> None:
    bad = server_factory(fail_first=100, fail_status=400)
    with pytest.raises(RemoteRewardError, match="rollout.rm_url .* HTTP 400: busy"):
        run(remote_hub(bad.url).score(None, sample("x", None)))
    assert len(bad.requests) == 1
    down = server_factory(fail_first=100, fail_status=500)
    with pytest.raises(RemoteRewardError, match="failed after 3 attempts"):
        run(remote_hub(down.url, rm_max_retries=2).score(None, sample("x", None)))
    assert len(down.requests) == 3


def test_remote_rm_times_out_then_retries(server_factory: Any) -> None:
    slow = server_factory(delay_s=0.5)
    with pytest.raises(RemoteRewardError, match="ReadTimeout"):
        run(remote_hub(slow.url, rm_timeout_s=0.1, rm_max_retries=1).score(None, sample("x", None)))
    assert len(slow.requests) == 2


def test_a_none_reward_names_the_function_that_returned_it():
    import asyncio

    from engines.rollout.rewards.hub import RewardHub
    from storage.sample import RewardError, Sample

    async def forgot_return(args, sample):
        sample.metadata["scored"] = True

    hub = RewardHub(default=forgot_return)
    sample = Sample(index=3, group_index=0, prompt="1+1=", label="2")
    with pytest.raises(RewardError, match=r"reward is None; returned by .*forgot_return"):
        asyncio.run(hub.assign(None, [sample]))
