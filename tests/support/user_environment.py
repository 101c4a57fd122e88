"""An environment a user wrote (`rollout.environment: tests.support.user_environment:make?size=N`):
two-digit additions, one chat turn, reward 1 when the reply holds the sum."""

from __future__ import annotations

from typing import Any

from openai import AsyncOpenAI

from engines.environments.base import MODEL_NAME, EnvironmentTask, EpisodeResult


class Additions:
    def __init__(self, uri: str, size: int) -> None:
        self.uri, self.size = uri, size
        self.episodes: list[tuple[str, EnvironmentTask, int]] = []
        self.closed = False

    def tasks(self, split: str) -> list[EnvironmentTask]:
        first = 0 if split == "train" else 1000
        return [EnvironmentTask(f"{a}+{a % 7}=", str(a + a % 7), {"a": a, "b": a % 7})
                for a in range(first + 10, first + 10 + self.size)]

    async def run_episode(self, base_url: str, task: EnvironmentTask, seed: int) -> EpisodeResult:
        self.episodes.append((base_url, task, seed))
        async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
            reply = await client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": task.prompt}])
        text = reply.choices[0].message.content or ""
        correct = float(str(task.answer) in text)
        return EpisodeResult(correct, {"correct": correct, "reply_chars": float(len(text))})

    def close(self) -> None:
        self.closed = True


def make(uri: str, size: str = "4", **unknown: Any) -> Additions:
    if unknown:
        raise TypeError(f"unknown arguments {sorted(unknown)}")
    return Additions(uri, int(size))


class Unreachable(Additions):
    """Its episodes fail as one whose server is down."""

    async def run_episode(self, base_url: str, task: EnvironmentTask, seed: int) -> EpisodeResult:
        raise ConnectionError("the environment server at 127.0.0.1:9 refused the connection")


def unreachable(uri: str, size: str = "4") -> Unreachable:
    return Unreachable(uri, int(size))
