"""The `openenv://` adapter without a server: its URI, its tasks, and the episode loop (how an
observation becomes chat messages and a reply an action) against a scripted environment
session and a scripted OpenAI client, the two external edges. The real server, gateway and
engine: tests/integration/test_openenv_env.py; the train flow: tests/flow/test_openenv_env_flow.py.
"""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from engines.environments.base import EnvironmentError, json_round_trip
from engines.environments.openenv_env import (
    FieldAdapter,
    OpenEnvArgs,
    StepReply,
    load_adapter,
    open_openenv_environment,
    parse_uri,
    play,
    ws_url,
)

URI = "openenv://pkg.games:Guess?size=4"


class ScriptedEnv:
    """An environment session answering each step from a script; records what it was sent."""

    def __init__(self, replies: list[StepReply], opening: StepReply | None = None) -> None:
        self.opening = opening or StepReply({"prompt": "guess"}, None, False)
        self.replies = list(replies)
        self.sent: list[Any] = []

    async def reset(self, seed: int) -> StepReply:
        self.sent.append(("reset", seed))
        return self.opening

    async def step(self, action: dict[str, Any], turn: int) -> StepReply:
        self.sent.append(("step", turn, action))
        return self.replies.pop(0)


class ScriptedLLM:
    """`chat.completions.create` answering from a script; records each call's messages."""

    def __init__(self, answers: list[str | tuple[str, str, int]]) -> None:
        self.answers = list(answers)
        self.calls: list[list[dict[str, Any]]] = []
        self.kwargs: list[dict[str, Any]] = []
        self.chat = SimpleNamespace(completions=self)

    async def create(self, *, model: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
        assert model == "policy"
        self.calls.append([dict(m) for m in messages])
        self.kwargs.append(kw)
        answer = self.answers.pop(0)
        text, reason, tokens = answer if isinstance(answer, tuple) else (answer, "stop", 1)
        return SimpleNamespace(choices=[SimpleNamespace(
            message=SimpleNamespace(content=text), finish_reason=reason)],
            usage=SimpleNamespace(completion_tokens=tokens))


def episode(llm: ScriptedLLM, env: ScriptedEnv, uri: str = URI, seed: int = 7) -> Any:
    target, args = parse_uri(uri)
    return asyncio.run(play(uri, llm, env, load_adapter(uri, args), args, seed))


def obs(text: str, reward: float | None = 0.0, done: bool = False) -> StepReply:
    return StepReply({"prompt": text, "tries": 1}, reward, done)


# -- the URI ---------------------------------------------------------------------------------
def test_a_module_form_is_started_here_and_a_url_form_is_connected_to() -> None:
    local, args = parse_uri("openenv://my_pkg.envs:Wordle?size=3&seed=10&max_turns=4")
    assert (local.import_path, local.url) == ("my_pkg.envs:Wordle", None)
    assert (args.size, args.seed, args.max_turns) == (3, 10, 4)
    for url, ws in [("http://10.0.0.2:8000", "ws://10.0.0.2:8000/ws"),
                    ("https://env.example.org/", "wss://env.example.org/ws"),
                    ("ws://h:1", "ws://h:1/ws")]:
        remote, _ = parse_uri(f"openenv://{url}?size=2")
        assert remote.import_path is None and remote.url == url.rstrip("/")
        assert ws_url(remote.url) == ws


@pytest.mark.parametrize("uri, words", [
    ("openenv://", ["openenv://pkg.module:EnvClass", "openenv://http://host:port"]),
    ("openenv://just_a_module", ["openenv://pkg.module:EnvClass"]),
    ("openenv://http://", ["openenv://http://host:port"]),
    ("openenv://a.b:C?sise=3", ["unknown argument ?sise=", "size"]),
    ("openenv://a.b:C?size=0", ["?size='0'", "greater than or equal to 1"]),
    ("openenv://a.b:C?size=many", ["?size='many'"]),
    ("openenv://a.b:C?reward=max", ["?reward='max'", "sum", "last"]),
    ("openenv://a.b:C?adapter=x.y:Z&observation=text", ["?adapter= replaces"]),
])
def test_a_bad_uri_is_refused_naming_the_uri_and_what_is_wrong(uri: str, words: list[str]) -> None:
    with pytest.raises(EnvironmentError) as err:
        parse_uri(uri)
    assert err.value.uri == uri and str(err.value).startswith(uri)
    for w in words:
        assert w in err.value.problem


def test_openenv_missing_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "openenv", None)  # find_spec: not installed
    with pytest.raises(EnvironmentError, match=r"openenv.*pip install 'rollflow\[envs\]'"):
        open_openenv_environment(URI)
    # a running server needs only the client side
    assert open_openenv_environment("openenv://http://127.0.0.1:9?size=1").uri


# -- tasks -----------------------------------------------------------------------------------
def test_tasks_are_reset_seeds_and_eval_has_a_range_of_its_own() -> None:
    env = open_openenv_environment("openenv://pkg.games:Guess?size=3&seed=5")
    train, held_out = env.tasks("train"), env.tasks("eval")
    assert [t.data["seed"] for t in train] == [5, 6, 7]
    assert [t.data["seed"] for t in held_out] == [1_000_005, 1_000_006, 1_000_007]
    assert all(json_round_trip(env.uri, t, i) == t for i, t in enumerate(train))
    env = open_openenv_environment("openenv://pkg.games:Guess?size=3&eval_size=2&eval_seed=50")
    assert [t.data["seed"] for t in env.tasks("eval")] == [50, 51]


# -- the episode -----------------------------------------------------------------------------
def test_an_observation_is_the_user_message_and_the_reply_the_action() -> None:
    env = ScriptedEnv([obs("higher"), obs("lower"), obs("yes", 1.0, done=True)])
    llm = ScriptedLLM(["3", "8", "6"])
    result = episode(llm, env, URI + "&system=play well", seed=11)
    assert env.sent == [("reset", 11), ("step", 0, {"message": "3"}),
                        ("step", 1, {"message": "8"}), ("step", 2, {"message": "6"})]
    # each call is the last one's history, its reply as the gateway recorded it, and the
    # observation that followed: a continuation, never a rewritten history (drift 0)
    assert llm.calls[0] == [{"role": "system", "content": "play well"},
                            {"role": "user", "content": "guess"}]
    for before, after, reply in zip(llm.calls, llm.calls[1:], ["3", "8"], strict=False):
        assert after[: len(before)] == before
        assert after[len(before):][0] == {"role": "assistant", "content": reply}
    assert llm.calls[2][-1] == {"role": "user", "content": "lower"}
    assert result.reward == 1.0
    assert result.metrics == {"env_steps": 3.0, "env_done": 1.0, "step_0_reward": 0.0,
                              "step_1_reward": 0.0, "step_2_reward": 1.0}


def test_the_fields_are_named_by_the_uri() -> None:
    opening = StepReply({"board": "_ _ _", "prompt": 3}, None, False)
    env = ScriptedEnv([StepReply({"board": "a _ _"}, 0.5, True)], opening)
    llm = ScriptedLLM(["a"])
    episode(llm, env, URI + "&observation=board&action=guess&max_tokens=5")
    assert llm.calls[0] == [{"role": "user", "content": "_ _ _"}]
    assert llm.kwargs[0] == {"max_tokens": 5}
    assert env.sent[1] == ("step", 0, {"guess": "a"})


def test_the_reward_is_the_sum_or_the_last_step_reward() -> None:
    def run(uri: str) -> Any:
        env = ScriptedEnv([obs("a", 0.25), obs("b", None), obs("c", 0.5, done=True)])
        return episode(ScriptedLLM(["1", "2", "3"]), env, uri)

    assert run(URI).reward == 0.75
    assert run(URI + "&reward=last").reward == 0.5
    assert run(URI).metrics["step_1_reward"] == 0.0  # no reward counts as 0


def test_an_episode_stops_at_max_turns_an_abort_or_a_spent_budget() -> None:
    env = ScriptedEnv([obs("a"), obs("b"), obs("c")])
    result = episode(ScriptedLLM(["1", "2"]), env, URI + "&max_turns=2")
    assert [s[0] for s in env.sent] == ["reset", "step", "step"]
    assert result.metrics["env_done"] == 0.0 and result.metrics["env_steps"] == 2.0

    env = ScriptedEnv([obs("a")])
    result = episode(ScriptedLLM(["1", ("", "abort", 0)]), env)
    assert len(env.sent) == 2  # the aborted reply is never stepped
    assert result.metrics["env_steps"] == 1.0

    env = ScriptedEnv([obs("a"), obs("b")])
    episode(ScriptedLLM([("12", "length", 2), ("", "length", 0)]), env)
    assert env.sent[1] == ("step", 0, {"message": "12"})  # a reply cut short is still played
    assert len(env.sent) == 2  # the next one had no tokens left


def test_same_task_and_same_answers_make_the_same_calls() -> None:
    def run() -> tuple[list[Any], list[Any]]:
        env = ScriptedEnv([obs("higher"), obs("yes", 1.0, True)])
        llm = ScriptedLLM(["1", "4"])
        episode(llm, env, seed=3)
        return env.sent, llm.calls

    assert run() == run()


@pytest.mark.parametrize("opening, words", [
    (StepReply({"text": "hi"}, None, False),
     ["seed 7, turn 0", "no field 'prompt'", "['text']", "?observation="]),
    (StepReply({"prompt": ["a", "b"]}, None, False), ["'prompt' is a list, not text"]),
    (StepReply({"prompt": "x"}, None, True), ["seed 7 was done at reset"]),
])
def test_an_observation_the_convention_cannot_read_fails_naming_the_field(
    opening: StepReply, words: list[str]
) -> None:
    with pytest.raises(EnvironmentError) as err:
        episode(ScriptedLLM(["1"]), ScriptedEnv([], opening))
    assert err.value.uri == URI
    for w in words:
        assert w in err.value.problem


class Wordle:
    """An adapter for an environment whose observation is a list of feedback lines."""

    def messages(self, observation: Any, turn: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": " ".join(observation["lines"])}]

    def action(self, reply: str, observation: Any) -> dict[str, Any]:
        return {"guess": reply.strip().lower()}


class Silent(Wordle):
    def messages(self, observation: Any, turn: int) -> list[dict[str, Any]]:
        return []


def test_an_adapter_named_by_the_uri_converts_both_ways() -> None:
    uri = URI + f"&adapter={__name__}:Wordle"
    env = ScriptedEnv([StepReply({"lines": ["no"]}, 1.0, True)],
                      StepReply({"lines": ["five", "letters"]}, None, False))
    llm = ScriptedLLM([" CRANE"])
    episode(llm, env, uri)
    assert llm.calls[0] == [{"role": "user", "content": "five letters"}]
    assert env.sent[1] == ("step", 0, {"guess": "crane"})

    with pytest.raises(EnvironmentError, match="needs a non-empty list"):
        episode(ScriptedLLM(["x"]), ScriptedEnv([]), URI + f"&adapter={__name__}:Silent")
    with pytest.raises(EnvironmentError, match=r"adapter=.*:Nope: cannot import"):
        open_openenv_environment(URI + f"&adapter={__name__}:Nope")
    with pytest.raises(EnvironmentError, match=r"needs messages\(observation, turn\)"):
        open_openenv_environment(URI + f"&adapter={__name__}:URI")


def test_the_default_adapter_is_typed_by_its_protocol() -> None:
    _, args = parse_uri(URI + "&observation=o&action=a&system=s")
    assert load_adapter(URI, args) == FieldAdapter("o", "a", "s")
    assert OpenEnvArgs().observation == "prompt" and OpenEnvArgs().action == "message"
