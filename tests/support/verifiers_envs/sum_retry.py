"""A multi-turn verifiers environment small enough for the tests' tiny models: the task is a
sum ("2+3="), the environment answers a wrong reply with "wrong, try again" and asks again,
up to `max_tries` replies. The rubric: 1 for a right first reply, 0.5 for a right later one,
0 otherwise. Open it as `verifiers://tests.support.verifiers_envs.sum_retry`; the taskset's
`split` (train, test) and `num_tasks` are URI arguments.
"""

from __future__ import annotations

from typing import Literal

import verifiers.v1 as vf

RETRY = "wrong, try again"
SUMS = {"train": [(2, 3), (1, 4), (3, 3), (2, 2)], "test": [(4, 1), (1, 2)]}


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def solved(self, trace: vf.Trace) -> float:
        replies = [(m.content or "").strip() for m in trace.assistant_messages]
        for tries, reply in enumerate(replies, start=1):
            if reply == str(self.data.answer):
                return 1.0 if tries == 1 else 0.5
        return 0.0

    @vf.metric
    async def tries(self, trace: vf.Trace) -> float:
        return float(len(trace.assistant_messages))


class SumRetryConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    num_tasks: int = 4


class SumRetryTaskset(vf.Taskset[SumTask, SumRetryConfig]):
    def load(self) -> list[SumTask]:
        sums = SUMS[self.config.split]
        return [SumTask(SumData(prompt=f"{a}+{b}=", answer=a + b), self.config.task)
                for a, b in (sums[i % len(sums)] for i in range(self.config.num_tasks))]


class SumRetryEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()
    max_tries: int = 2


class SumRetryEnv(vf.Env[SumRetryEnvConfig]):
    """The environment plays the user: each wrong reply gets "wrong, try again"."""

    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        answer = str(task.data.answer)
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            tries = 1
            while not segment.terminated and segment.last_reply != answer \
                    and tries < self.config.max_tries:
                segment = await interaction.turn(RETRY)
                tries += 1


__all__ = ["SumRetryEnv", "SumRetryTaskset"]
