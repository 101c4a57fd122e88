"""What rollflow needs from an environment brought from outside: its tasks, an episode, a reward.

An environment (a verifiers environment, an OpenEnv server, one a user wrote) is named by
`rollout.environment` and opened once per process (`engines.environments.registry`). rollflow
then:

- reads its tasks as prompt rows (`tasks("train")` for training, `tasks("eval")` for a
  held-out set named by the same URI in `eval.datasets`); each row's metadata keeps the whole
  task, JSON round-tripped, so a restored or replayed sample starts the same episode;
- runs one episode per sample against the agent gateway (`engines/rollout/agent_gateway.py`):
  the environment talks OpenAI chat to `base_url`, and the sample is built from the exact
  tokens of those calls, never re-tokenized;
- trains on the episode's reward, and keeps its named parts (a rubric's functions, per-step
  rewards) in `sample.metadata["environment"]["metrics"]`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Split = Literal["train", "eval"]
METADATA_KEY = "environment"
"""The key of a row's metadata holding `{"uri", "split", "index", "task"}`."""
MODEL_NAME = "policy"
"""The model name an episode sends (the gateway serves the policy under any name)."""


class EnvironmentError(ValueError):  # noqa: A001 - rollflow's, not the builtin OSError alias
    """An environment that cannot be opened or whose tasks or episodes are malformed; the
    message names the URI (and the task) so the user can find it."""

    def __init__(self, uri: str, problem: str) -> None:
        super().__init__(f"{uri}: {problem}")
        self.uri, self.problem = uri, problem

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.uri, self.problem), vars(self)


@dataclass(frozen=True)
class EnvironmentTask:
    """One task: `prompt` is what a person reads in the sample, `answer` its label if it has
    one, `data` everything (JSON-able) the episode needs to start exactly again."""

    prompt: str
    answer: str | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "answer": self.answer, "data": dict(self.data)}

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> EnvironmentTask:
        return cls(str(value["prompt"]), value.get("answer"), dict(value.get("data") or {}))


@dataclass(frozen=True)
class EpisodeResult:
    """The episode's reward, and its named parts (each a number) for the sample's metadata."""

    reward: float
    metrics: Mapping[str, float] = field(default_factory=dict)


class Environment(Protocol):
    """An opened environment. `run_episode` may be called for many samples at once on the
    rollout's event loop; `close` releases what `open` started (servers, pools)."""

    uri: str

    def tasks(self, split: Split) -> Sequence[EnvironmentTask]: ...

    async def run_episode(self, base_url: str, task: EnvironmentTask, seed: int) -> EpisodeResult:
        """One episode of `task`, every model call through the OpenAI endpoint `base_url`
        (api key: anything; model: `MODEL_NAME`); `seed` is the sample's, for any randomness
        the environment draws itself."""
        ...

    def close(self) -> None: ...


def json_round_trip(uri: str, task: EnvironmentTask, index: int) -> EnvironmentTask:
    """The task as a stored sample will give it back; a task JSON cannot hold is refused
    here, at read time, naming it, rather than changing after a restart."""
    try:
        return EnvironmentTask.from_json(json.loads(json.dumps(task.to_json())))
    except (TypeError, ValueError) as e:
        raise EnvironmentError(uri, f"task {index} cannot be stored as JSON: {e}") from None
