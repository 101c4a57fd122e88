"""An endless verifiers taskset (single-turn sums "i+1="), for the tests of `limit`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import verifiers.v1 as vf


class EndlessData(vf.TaskData):
    answer: int


class EndlessTask(vf.Task[EndlessData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == str(self.data.answer))


class EndlessSums(vf.Taskset[EndlessTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self) -> Iterator[EndlessTask]:
        for i in itertools.count():
            yield EndlessTask(EndlessData(prompt=f"{i}+1=", answer=i + 1), self.config.task)


__all__ = ["EndlessSums"]
