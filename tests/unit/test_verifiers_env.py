"""`verifiers://` URIs (engines/environments/verifiers_env.py): their arguments, the tasks
they list, the rows a stored sample gives back, the errors that name what is wrong, and the
calls an episode makes (against a scripted OpenAI endpoint; tests/integration/
test_verifiers_episode.py runs episodes on the real gateway and engine)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from engines.environments.base import EnvironmentError, EnvironmentTask, json_round_trip
from engines.environments.verifiers_env import open_verifiers_environment, parse_uri

pytest.importorskip("verifiers.v1")  # rollflow[envs]
from tests.support.verifiers_envs.sum_retry import RETRY  # noqa: E402

SUM_RETRY = "verifiers://tests.support.verifiers_envs.sum_retry"
ENDLESS = "verifiers://tests.support.verifiers_envs.endless_sums"


def test_arguments_nest_by_dots_and_read_json() -> None:
    env_id, args = parse_uri(
        "verifiers://owner/name@0.1?split=test&task.tolerance=0.5&eval.split=x&eval.limit=2"
        "&ids=[1,2]&env=user-sim")
    assert env_id == "owner/name@0.1"
    assert args == {"split": "test", "task": {"tolerance": "0.5"}, "eval": {"split": "x",
                    "limit": "2"}, "ids": [1, 2], "env": "user-sim"}


@pytest.mark.parametrize(("uri", "problem"), [
    ("verifiers://", "no environment id"),
    ("verifiers://?split=x", "no environment id"),
    ("openenv://x", "starts with verifiers://"),
    ("verifiers://x?a.=1", "'a.': an empty name"),
    ("verifiers://x?a=1&a.b=2", "'a.b': 'a' is given a value too"),
    ("verifiers://x?a.b=2&a=1", "'a': it also has fields"),
    ("verifiers://x?ids=[1,", "'ids': not JSON"),
])
def test_malformed_uris_say_what_is_wrong(uri: str, problem: str) -> None:
    with pytest.raises(EnvironmentError, match=problem) as err:
        parse_uri(uri)
    assert err.value.uri == uri


def test_tasks_of_each_split_and_the_rows_a_stored_sample_gives_back() -> None:
    env = open_verifiers_environment(f"{SUM_RETRY}?num_tasks=3&eval.split=test&eval.limit=1")
    train, held_out = env.tasks("train"), env.tasks("eval")
    assert [(t.prompt, t.answer) for t in train] == [("2+3=", "5"), ("1+4=", "5"), ("3+3=", "6")]
    assert [(t.prompt, t.answer) for t in held_out] == [("4+1=", "5")]
    for i, task in enumerate([*train, *held_out]):
        stored = json_round_trip(env.uri, task, i)
        assert stored == task
        # the verifiers task the stored row restarts is the one the taskset built
        assert env._task(stored).data == env._load(task.data["split"])[i % 3].data
    assert env.tasks("train") == train  # listed once, the same every time


def test_limits_bound_an_endless_taskset() -> None:
    assert [t.prompt for t in open_verifiers_environment(f"{ENDLESS}?limit=2").tasks("train")] \
        == ["0+1=", "1+1="]
    with pytest.raises(EnvironmentError, match="never ends: bound it with limit=<n>"):
        open_verifiers_environment(ENDLESS).tasks("train")


@pytest.mark.parametrize(("uri", "problem"), [
    ("verifiers://no_such_env_xyz", "taskset 'no_such_env_xyz' not found"),
    ("verifiers://no_such_pkg_xyz.env", "cannot import no_such_pkg_xyz.env"),
    (f"{SUM_RETRY}?split=nope", "split: Input should be 'train' or 'test'"),
    (f"{SUM_RETRY}?num_taks=3", "num_taks: Extra inputs are not permitted"),
    (f"{SUM_RETRY}?eval.split=nope", "eval.split: Input should be"),
    (f"{SUM_RETRY}?env.max_tries=x", "env.max_tries: Input should be a valid integer"),
    (f"{SUM_RETRY}?env.player=x", "env.player: seats are set by rollflow"),
    (f"{SUM_RETRY}?limit=0", "limit: a number of tasks, at least 1"),
    (f"{SUM_RETRY}?eval=x", "eval: give eval.<taskset field>=<value>"),
    (f"{SUM_RETRY}?harness=no_such_harness", "harness 'no_such_harness' not found"),
    (f"{SUM_RETRY}?env=user-sim", r"seats \['assistant', 'user'\] all play the policy"),
])
def test_bad_environments_and_arguments_are_refused_by_name(uri: str, problem: str) -> None:
    with pytest.raises(EnvironmentError, match=problem) as err:
        open_verifiers_environment(uri)
    assert str(err.value).startswith(uri)


def test_no_held_out_set_without_eval_arguments() -> None:
    with pytest.raises(EnvironmentError, match="no held-out set: .*eval.split=test"):
        open_verifiers_environment(SUM_RETRY).tasks("eval")


def test_without_verifiers_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # import verifiers.v1 fails
    with pytest.raises(EnvironmentError, match=r"pip install 'rollflow\[envs\]'"):
        open_verifiers_environment(SUM_RETRY)


Reply = Callable[[list[dict[str, Any]]], Awaitable[web.Response]]


def scripted(reply: Reply, uri: str, sessions: int = 1) -> tuple[list[Any], list[list[Any]]]:
    """Episodes of the environment's first task, one per session of an OpenAI endpoint
    whose answers `reply` gives: (results, each session's request bodies)."""
    env = open_verifiers_environment(uri)
    task = EnvironmentTask.from_json(env.tasks("train")[0].to_json())
    bodies: list[list[Any]] = [[] for _ in range(sessions)]

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        bodies[int(request.match_info["k"])].append(body)
        return await reply(body["messages"])

    async def go() -> list[Any]:
        app = web.Application()
        app.router.add_post("/s/{k}/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return list(await asyncio.gather(
                *(env.run_episode(f"http://127.0.0.1:{port}/s/{k}/v1", task, k)
                  for k in range(sessions)), return_exceptions=True))
        finally:
            await runner.cleanup()
            env.close()
    return asyncio.run(go()), bodies


def answer(text: str) -> web.Response:
    return web.json_response({
        "id": "c", "object": "chat.completion", "created": 0, "model": "policy",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})


async def wrong_then_right(messages: list[dict[str, Any]]) -> web.Response:
    return answer("5" if messages[-1]["content"] == RETRY else "4")


def test_an_episode_makes_the_same_calls_and_the_rubric_is_the_reward() -> None:
    results, bodies = scripted(wrong_then_right, SUM_RETRY, sessions=3)
    first = [{"role": "user", "content": "2+3="}]
    second = [*first, {"role": "assistant", "content": "4"}, {"role": "user", "content": RETRY}]
    # each session: the prompt, then the environment's reply after the model's, nothing else
    # (no sampling parameters: the gateway applies the rollout's)
    assert bodies == [[{"model": "policy", "messages": first},
                       {"model": "policy", "messages": second}]] * 3
    assert [(r.reward, dict(r.metrics)) for r in results] == [
        (0.5, {"reward/solved": 0.5, "metric/tries": 2.0, "turns": 2.0})] * 3


def test_a_right_first_reply_ends_the_episode() -> None:
    async def right(messages: list[dict[str, Any]]) -> web.Response:
        return answer("5")
    (result,), (calls,) = scripted(right, SUM_RETRY)
    assert len(calls) == 1 and result.reward == 1.0 and result.metrics["turns"] == 1.0


def test_a_failed_episode_fails_its_sample_with_verifiers_error() -> None:
    async def broken(messages: list[dict[str, Any]]) -> web.Response:
        return web.json_response({"error": {"message": "engine down"}}, status=500)
    (result,), _ = scripted(broken, SUM_RETRY)
    assert isinstance(result, EnvironmentError)
    assert "episode of '2+3=' failed" in str(result) and "engine down" in str(result)
