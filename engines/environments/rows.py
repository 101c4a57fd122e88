"""An environment's tasks as a prompt-set shard, and a sample's episode as an agent.

Rows: `{input_key: task.prompt, label_key: task.answer, metadata_key: {"environment": {"uri",
"split", "index", "task"}}}`, made when read like reasoning-gym's (engines/data/reasoning_gym.py).
The whole task rides in the metadata, JSON round-tripped when the set is opened, so a sample restored
from the journal or replayed from a saved batch starts the same episode as the first time.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engines.environments.base import (
    METADATA_KEY,
    EnvironmentError,
    EnvironmentTask,
    Split,
    json_round_trip,
)
from engines.environments.registry import open_environment
from engines.hooks.protocols import AgentFn
from storage.sample import Sample


class EnvironmentShard:
    """The tasks of one split of an environment as the rows of a prompt set."""

    def __init__(self, uri: str, split: Split, input_key: str, label_key: str | None,
                 metadata_key: str | None) -> None:
        if metadata_key is None:
            raise EnvironmentError(uri, "an environment's rows keep their task in the metadata; "
                                   "set data.metadata_key (default 'metadata')")
        self.name, self.split = uri, split
        self.keys = input_key, label_key, metadata_key
        self.tasks = [json_round_trip(uri, task, i)
                      for i, task in enumerate(open_environment(uri).tasks(split))]
        if not self.tasks:
            raise EnvironmentError(uri, f"no {split} tasks")
        self.num_rows = len(self.tasks)

    def line(self, i: int) -> int:
        return i + 1

    def rows(self, local: np.ndarray) -> list[dict[str, Any]]:
        return [self.row(int(i)) for i in local]

    def row(self, i: int) -> dict[str, Any]:
        task = self.tasks[i]
        input_key, label_key, metadata_key = self.keys
        row: dict[str, Any] = {input_key: task.prompt}
        if label_key is not None and task.answer is not None:
            row[label_key] = str(task.answer)
        row[metadata_key] = {METADATA_KEY: {"uri": self.name, "split": self.split, "index": i,
                                            "task": task.to_json()}}
        return row


def environment_agent(uri: str) -> AgentFn:
    """The agent of `rollout.environment`: each sample plays its row's task as one episode
    through its gateway session; the episode's reward is the sample's, and its named parts go
    to `metadata.environment.metrics`."""

    async def play_episode(base_url: str, sample: Sample, /, **kwargs: Any) -> float:
        entry = sample.metadata.get(METADATA_KEY)
        if not isinstance(entry, dict) or "task" not in entry:
            raise EnvironmentError(uri, f"{sample.describe()} has no metadata.{METADATA_KEY}.task "
                                   "(its prompt did not come from the environment)")
        env = open_environment(str(entry.get("uri", uri)))
        task = EnvironmentTask.from_json(entry["task"])
        seed = int(kwargs.get("sampling_params", {}).get("sampling_seed", sample.index))
        result = await env.run_episode(base_url, task, seed)
        entry["metrics"] = {k: float(v) for k, v in result.metrics.items()}
        return float(result.reward)

    return play_episode
