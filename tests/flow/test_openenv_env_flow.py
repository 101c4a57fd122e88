"""An OpenEnv environment trained by GRPO through `rollflow train`
(`rollout.environment: openenv://tests.support.openenv_envs:GuessDigit?...`): the rollout
actor starts the environment's server itself, and each sample is one episode of the
guess-a-digit game through the agent gateway; embedded engine, torch trainer, real Ray and
Prefect.

The policy guesses digits at random (tests/support/openenv_envs.py: guess_model), so episodes
take one to three turns and groups have both rewards. Every model token of every trained
sample must be the engine's, with its log-prob and loss mask 1; every other token loss mask 0
and log-prob 0; no call may drift from the recorded conversation; each reward must be the one
the game gives for the sample's guesses; and a kill -9 of the driver mid-run, then the same
command, must train the same samples (tokens, loss masks, rewards) as an uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.support.agent_runs import (
    assert_every_step_without_drift,
    assert_kill_and_rerun_trains_the_same,
    assert_step_0_turns_are_the_engines,
    environment_config,
    model_turns,
    train_three_steps,
)
from tests.support.openenv_envs import GuessAction, GuessDigit, guess_model

URI = "openenv://tests.support.openenv_envs:GuessDigit?size=8&max_turns=4"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return guess_model(str(tmp_path_factory.mktemp("openenv") / "guesser"))


def config(name: str, model: str, tmp_path: Any, ray_address: str) -> Any:
    return environment_config(name, URI, model, tmp_path, ray_address, max_response_len=72)




def game_reward(seed: int, guesses: list[str]) -> float:
    """The game's reward for these guesses, played here without a server."""
    game = GuessDigit()
    game.reset(seed)
    return sum(float(game.step(GuessAction(message=g)).reward or 0.0) for g in guesses)


def test_openenv_env_trains_with_exact_tokens_and_resumes_after_kill(
    prefect_api: str, ray_address: str, model: str, tmp_path: Any
) -> None:
    reference = config("openenv", model, tmp_path, ray_address)
    layout, samples = train_three_steps(reference)
    assert {s.reward for s in samples} == {0.0, 1.0}  # the policy gradient is not zero
    tok = AutoTokenizer.from_pretrained(model)
    for s in samples:
        env = s.metadata["environment"]
        assert env["uri"] == URI and env["split"] == "train"
        turns = model_turns(s)
        guesses = [str(tok.decode(s.tokens[a:b], skip_special_tokens=True)) for a, b in turns]
        assert s.reward == game_reward(env["task"]["data"]["seed"], guesses)
        assert s.metadata["agent_turns"] == env["metrics"]["env_steps"] == len(turns)
    assert max(s.metadata["agent_turns"] for s in samples) > 1  # the environment spoke again
    assert_every_step_without_drift(layout)

    assert_step_0_turns_are_the_engines(layout, model, reference.rollout.seed)

    # kill -9 of the driver once step 0 committed, then the same command
    cfg = config("openenv-kill", model, tmp_path, ray_address)
    assert_kill_and_rerun_trains_the_same(cfg, tmp_path, prefect_api, samples)
