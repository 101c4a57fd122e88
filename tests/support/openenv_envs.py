"""Small OpenEnv environments built on openenv's own server classes, for the `openenv://`
adapter's tests (engines/environments/openenv_env.py), and a server for one in a thread.

`GuessDigit` is a multi-turn text game the tiny models can play: reset(seed) draws a secret
digit from the seed, the player has three guesses, each answered "higher", "lower" or "yes";
a right guess ends the episode with reward 1. A reply's first digit is its guess. Its texts use
only characters the tiny models' tokenizer knows.
"""

from __future__ import annotations

import os
import random
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

GUESSES = 3
OPENING = "guess a digit from 0 to 9"
MODEL_TOKENS = [str(d) for d in range(10)]  # what a bigram policy writes after "assistant: "


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str


class GuessDigit(Environment[GuessAction, GuessObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State()
        self._secret = 0

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._secret = random.Random(seed).randrange(10)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=OPENING, reward=None, done=False)

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        digits = re.findall(r"\d", action.message)
        guess = int(digits[0]) if digits else None
        if guess == self._secret:
            return GuessObservation(prompt="yes", reward=1.0, done=True)
        done = self._state.step_count >= GUESSES
        hint = "no digit" if guess is None else "higher" if guess < self._secret else "lower"
        return GuessObservation(prompt=f"no, it was {self._secret}" if done else hint,
                                reward=0.0, done=done)

    @property
    def state(self) -> State:
        return self._state


class CrashingGuessDigit(GuessDigit):
    """Its server process dies at the first step of an episode whose seed is odd."""

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        self._crash = bool(seed is not None and seed % 2)
        return super().reset(seed, episode_id)

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        if self._crash:
            os._exit(3)
        return super().step(action, timeout_s)


class AnnotatedGuessDigit(Environment):  # type: ignore[type-arg]
    """GuessDigit whose Action and Observation classes are known only from `step`'s
    annotations (no generic arguments), served by the adapter all the same."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.game = GuessDigit()

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              **kwargs: Any) -> GuessObservation:
        return self.game.reset(seed, episode_id)

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        return self.game.step(action)

    @property
    def state(self) -> State:
        return self.game.state


guess_digit_app = create_fastapi_app(GuessDigit, GuessAction, GuessObservation,
                                     max_concurrent_envs=1)
"""An app as OpenEnv environments ship one (`server/app.py`), with a single session."""


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """`app` served by uvicorn in a thread of this process; yields its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def guess_model(out_dir: str) -> str:
    """A policy for GuessDigit: the agent example's tiny chat model rewired into a bigram
    model (tests/support/bigram_model.py) that answers a turn with one digit, uniformly at
    random, then `<eos>`: about one episode in three finds the digit, so groups have both
    rewards."""
    from examples.openai_agent.model import save_agent_model
    from tests.support.bigram_model import save_bigram_model

    base = save_agent_model(out_dir + "-random")
    return save_bigram_model(base, out_dir, marked=MODEL_TOKENS, after_unmarked=MODEL_TOKENS,
                             after_marked=["<eos>"])
