"""`openenv://` episodes against real OpenEnv servers: one the adapter starts in a child
process (`openenv://tests.support.openenv_envs:GuessDigit`), one served by this process
(`openenv://http://...`), through the real agent gateway and an embedded engine serving a
policy that guesses digits at random (tests/support/openenv_envs.py).

Each sample must be the conversation the environment and the engine had, token for token:
the model's tokens the engine's output for the tokens before them (with that turn's seed and
its log-probs), the environment's text its own rendering, no drift; its reward the one the
game gives for those guesses; the same again when played again, and the same whichever way
the server is reached. A server that dies mid-episode fails that sample, naming the URI, the
seed and the exit, and the next episode gets a new server.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from engines.chat.template import encode_text, render_text
from engines.environments.base import METADATA_KEY, EnvironmentError, EnvironmentTask
from engines.environments.openenv_env import (
    OpenEnvEnvironment,
    WebSocketSession,
    load_adapter,
    open_openenv_environment,
    parse_uri,
    play,
)
from engines.environments.registry import close_environments, open_environment
from engines.environments.rows import environment_agent
from engines.inference.engine_actor import EngineActor
from engines.rollout.agent_gateway import SEED_STRIDE, AgentGateway
from flows.config.run import EngineConfig
from storage.sample import Sample, Status
from tests.support.agent_runs import model_turns
from tests.support.openenv_envs import (
    GUESSES,
    GuessAction,
    GuessDigit,
    guess_digit_app,
    guess_model,
    serving,
)

QUERY = "?size=6&max_turns=4"
LOCAL = "openenv://tests.support.openenv_envs:GuessDigit" + QUERY


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineActor]:
    threads = torch.get_num_threads()
    model = guess_model(str(tmp_path_factory.mktemp("openenv") / "guesser"))
    actor = EngineActor(EngineConfig(backend="embedded", model_path=model), 0, num_threads=1)
    yield actor
    actor.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def closed_environments() -> Iterator[None]:
    yield
    close_environments()


def sampling(seed: int) -> dict[str, Any]:
    return {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 80, "stop": [],
            "skip_special_tokens": True, "no_stop_trim": False, "sampling_seed": seed}


def play_samples(engine: EngineActor, uri: str, tasks: Sequence[EnvironmentTask],
                 per_task: int = 2, concurrently: bool = True) -> list[Sample]:
    """`per_task` samples of each task (a group), each an episode through the gateway, as
    the rollout runs them (engines/environments/rows.py: environment_agent)."""
    samples = [Sample(index=i, group_index=i // per_task, prompt=t.prompt, tokens=[1],
                      metadata={METADATA_KEY: {"uri": uri, "task": t.to_json()}})
               for i, t in enumerate(t for t in tasks for _ in range(per_task))]

    async def go() -> list[Sample]:
        gateway = AgentGateway(SimpleNamespace(engine_url=engine.url()),
                               engine.generator.tokenizer)  # type: ignore[attr-defined]
        await gateway.start()
        agent = environment_agent(uri)
        try:
            runs = [gateway.run_sample(agent, s, sampling(100 + s.index)) for s in samples]
            if concurrently:
                return list(await asyncio.gather(*runs))
            return [await run for run in runs]
        finally:
            await gateway.stop()

    return asyncio.run(go())



def check_episode(engine: EngineActor, s: Sample) -> None:
    """The sample is the game the engine played: its turns the engine's, its reward and
    its environment text the game's own."""
    tok = engine.generator.tokenizer  # type: ignore[attr-defined]
    seed = s.metadata[METADATA_KEY]["task"]["data"]["seed"]
    assert s.status == Status.COMPLETED, s.metadata.get("agent_error")
    assert "token_drift_turns" not in s.metadata  # every call continued the recorded one
    assert "retokenize_mismatch_turns" not in s.metadata
    turns = model_turns(s)
    replies = [tok.decode(s.tokens[a:b], skip_special_tokens=True) for a, b in turns]
    game = GuessDigit()
    conversation = [{"role": "user", "content": game.reset(seed).prompt}]
    reward = 0.0
    for reply in replies:
        step = game.step(GuessAction(message=reply))
        conversation += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": step.prompt}]
        reward += float(step.reward or 0.0)
    assert step.done and len(replies) <= GUESSES
    assert s.reward == reward
    metrics = s.metadata[METADATA_KEY]["metrics"]
    assert metrics["env_steps"] == len(replies) and metrics["env_done"] == 1.0
    # the tokens are the conversation's rendering up to the last reply's <eos>
    rendered = encode_text(tok, render_text(tok, conversation[:-1], add_generation_prompt=False))
    assert s.tokens == rendered[:-1]
    logprob = dict(enumerate(s.rollout_log_probs, start=s.prompt_length))
    for turn, (a, b) in enumerate(turns):
        body = {"input_ids": s.tokens[:a], "return_logprob": True,
                "sampling_params": {**sampling(100 + s.index), "max_new_tokens": b - a,
                                    "sampling_seed": 100 + s.index + SEED_STRIDE * turn}}
        native = httpx.post(engine.url() + "/generate", json=body, timeout=60).json()
        assert native["output_ids"] == s.tokens[a:b]
        assert [x[0] for x in native["meta_info"]["output_token_logprobs"]] == \
            [logprob[i] for i in range(a, b)]
    masked = [lp for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if not m]
    assert masked == [0.0] * len(masked)


def key(samples: list[Sample]) -> list[Any]:
    return [(s.index, s.tokens, s.loss_mask, s.rollout_log_probs, s.reward) for s in samples]


@pytest.fixture(scope="module")
def local_samples(engine: EngineActor) -> list[Sample]:
    return play_samples(engine, LOCAL, open_environment(LOCAL).tasks("train"))


def test_a_started_server_plays_episodes_with_the_engines_tokens(
    engine: EngineActor, local_samples: list[Sample]
) -> None:
    assert len(local_samples) == 12
    for s in local_samples:
        check_episode(engine, s)
    assert {s.reward for s in local_samples} == {0.0, 1.0}
    assert max(len(model_turns(s)) for s in local_samples) > 1  # multi-turn episodes
    again = play_samples(engine, LOCAL, open_environment(LOCAL).tasks("train"))
    assert key(again) == key(local_samples)
    server = open_environment(LOCAL).server  # type: ignore[attr-defined]
    assert server.starts == 1


def test_a_running_server_gives_the_same_episodes_one_session_at_a_time(
    engine: EngineActor, local_samples: list[Sample]
) -> None:
    with serving(guess_digit_app) as url:  # max_concurrent_envs=1: the others wait
        uri = f"openenv://{url}{QUERY}"
        remote = play_samples(engine, uri, open_environment(uri).tasks("train"))
    assert key(remote) == key(local_samples)


def test_a_server_that_dies_mid_episode_fails_the_sample_and_is_started_again(
    engine: EngineActor,
) -> None:
    uri = "openenv://tests.support.openenv_envs:CrashingGuessDigit?size=2&max_turns=4"
    env = open_environment(uri)
    odd, even = env.tasks("train")[1], env.tasks("train")[0]  # seeds 1 (crashes) and 0
    crashed, ok = play_samples(engine, uri, [odd, even], per_task=1, concurrently=False)
    assert crashed.status == Status.FAILED and crashed.reward == 0.0
    error = crashed.metadata["agent_error"]
    for words in (uri, "closed the connection during the step 0 of the episode of seed 1",
                  "exited with code 3"):
        assert words in error
    check_episode(engine, ok)
    assert env.server.starts == 2  # type: ignore[attr-defined]


def test_a_target_that_cannot_be_served_is_named() -> None:
    async def episode(uri: str) -> Any:
        env = open_openenv_environment(uri)
        try:
            return await env.run_episode("http://127.0.0.1:9/v1", env.tasks("train")[0], 0)
        finally:
            env.close()

    for uri, words in [
        ("openenv://tests.support.no_such_module:Env", ["exited with code 1",
                                                        "No module named 'tests.support.no_"]),
        ("openenv://tests.support.openenv_envs:GUESSES", ["GUESSES is neither an openenv "
                                                          "Environment subclass nor an app"]),
    ]:
        with pytest.raises(EnvironmentError) as err:
            asyncio.run(episode(uri))
        assert err.value.uri == uri
        for w in words:
            assert w in err.value.problem


class Answers:
    """A scripted OpenAI client: the model's replies, without an engine."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.chat = SimpleNamespace(completions=self)

    async def create(self, **kw: Any) -> Any:
        return SimpleNamespace(choices=[SimpleNamespace(
            message=SimpleNamespace(content=self.answers.pop(0)), finish_reason="stop")],
            usage=SimpleNamespace(completion_tokens=1))


async def scripted(env: OpenEnvEnvironment, seed: int, *answers: str) -> Any:
    async with WebSocketSession(env.uri, env.server, env.args) as session:
        return await play(env.uri, Answers(*answers), session, env.adapter, env.args, seed)


def test_an_environment_typed_by_its_step_annotations_is_served() -> None:
    env = open_openenv_environment("openenv://tests.support.openenv_envs:AnnotatedGuessDigit")
    try:
        secret = random.Random(4).randrange(10)
        result = asyncio.run(scripted(env, 4, str((secret + 1) % 10), str(secret)))
        assert result.reward == 1.0 and result.metrics["env_steps"] == 2.0
    finally:
        env.close()


def test_an_action_the_environment_refuses_names_the_field() -> None:
    with serving(guess_digit_app) as url:
        uri = f"openenv://{url}?action=guess"
        target, args = parse_uri(uri)
        env = OpenEnvEnvironment(target, args, load_adapter(uri, args))
        with pytest.raises(EnvironmentError) as err:
            asyncio.run(scripted(env, 0, "5"))
    for words in ("refused the step 0 of the episode of seed 0: VALIDATION_ERROR",
                  'the action was {"guess": "5"}', "?action="):
        assert words in err.value.problem
