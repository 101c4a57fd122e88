"""slime's RolloutDataSourceWithBuffer, with the buffer's contents saved on every step.

Groups come from the buffer first (through the buffer filter; partial rollouts and
recycled groups wait there), then from the dataset, epoch by epoch, shuffled per epoch with a
seed derived from (seed, epoch). Each group is `n_samples_per_prompt` deep copies of one prompt with
consecutive global sample indices. The state (epoch, offset, counters, buffer) is saved per
rollout_id so a resumed run draws exactly the same groups as an uninterrupted one.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from storage.batch_io import read_samples, write_samples
from storage.run_layout import RunLayout
from storage.sample import Group, Sample, Status

BufferFilter = Callable[[Any, int, list[Group], int], list[Group]]


def pop_first(args: Any, rollout_id: int, buffer: list[Group], num_samples: int) -> list[Group]:
    """Default buffer filter: the oldest `num_samples` groups."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


@dataclass
class DataSourceState:
    epoch_id: int = 0
    sample_offset: int = 0
    sample_index: int = 0
    group_index: int = 0
    rollout_id: int = -1  # the step whose draws this state includes


def groups_in_order(samples: list[Sample]) -> list[Group]:
    """Regroup a flat list by group_index, keeping the order groups first appear in."""
    groups: dict[int, Group] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


class RolloutDataSourceWithBuffer:
    def __init__(
        self,
        prompts: list[Sample],
        n_samples_per_prompt: int,
        seed: int = 42,
        shuffle: bool = True,
        buffer_filter: BufferFilter = pop_first,
        hook_args: Any = None,
    ) -> None:
        if not prompts:
            raise ValueError("the prompt dataset is empty")
        self.prompts = prompts
        self.n_samples_per_prompt = n_samples_per_prompt
        self.seed = seed
        self.shuffle = shuffle
        self.buffer_filter = buffer_filter
        self.hook_args = hook_args
        self.buffer: list[Group] = []
        self.state = DataSourceState()
        self._order = self._epoch_order(0)

    # -- drawing -------------------------------------------------------------------------
    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def _next_prompts(self, n: int) -> list[Sample]:
        out: list[Sample] = []
        while len(out) < n:
            if self.state.sample_offset >= len(self._order):
                self.state.epoch_id += 1
                self.state.sample_offset = 0
                self._order = self._epoch_order(self.state.epoch_id)
            take = min(n - len(out), len(self._order) - self.state.sample_offset)
            start = self.state.sample_offset
            out.extend(self.prompts[i] for i in self._order[start : start + take])
            self.state.sample_offset += take
        return out

    def _make_group(self, prompt: Sample) -> Group:
        group = []
        for _ in range(self.n_samples_per_prompt):
            s = prompt.clone()
            s.index = self.state.sample_index
            s.group_index = self.state.group_index
            s.status = Status.PENDING
            self.state.sample_index += 1
            group.append(s)
        self.state.group_index += 1
        return group

    def get_samples(self, num_groups: int, rollout_id: int = 0) -> list[Group]:
        """`num_groups` groups: buffered ones first, then fresh prompts."""
        groups: list[Group] = []
        if self.buffer:
            groups = self.buffer_filter(self.hook_args, rollout_id, self.buffer, num_groups)
        fresh = self._next_prompts(num_groups - len(groups))
        groups.extend(self._make_group(p) for p in fresh)
        self.state.rollout_id = rollout_id
        return groups

    def add_samples(self, groups: list[Group]) -> None:
        """Return whole groups to the buffer (partial rollouts, recycled groups)."""
        for g in groups:
            if len(g) != self.n_samples_per_prompt:
                raise ValueError(
                    f"group {g[0].group_index if g else '?'} has {len(g)} samples; "
                    f"expected n_samples_per_prompt={self.n_samples_per_prompt}"
                )
            if len({s.group_index for s in g}) != 1:
                raise ValueError("a group's samples must share one group_index")
        self.buffer.extend(groups)

    # -- state ---------------------------------------------------------------------------
    def save(
        self,
        layout: RunLayout,
        rollout_id: int,
        compression: str | None = "zstd",
        stage: str = "sample_prompts",
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Buffer first, then the JSON that references it: the JSON is the commit point.

        Each stage of a step writes its own buffer file, so a stage that crashes between
        the two writes leaves the previous stage's state intact (the JSON still names the
        previous buffer). `stage` and `extra` tell a re-run stage whether it already ran.
        """
        buffer_name = f"{rollout_id:06d}.{stage}.buffer.arrow"
        flat = [s for g in self.buffer for s in g]
        write_samples(layout.store, flat, "datasource", buffer_name, compression=compression)
        meta = {
            **asdict(self.state),
            "buffer_groups": len(self.buffer),
            "buffer_file": buffer_name,
            "stage": stage,
            "extra": extra or {},
        }
        layout.store.write_json(meta, *layout.datasource_parts(rollout_id, ".json"))

    def load(self, layout: RunLayout, rollout_id: int) -> dict[str, Any]:
        """Restore the state saved for `rollout_id`; returns its meta (stage, extra)."""
        meta: dict[str, Any] = layout.store.read_json(
            *layout.datasource_parts(rollout_id, ".json")
        )
        self.state = DataSourceState(
            **{k: meta[k] for k in asdict(DataSourceState()) if k in meta}
        )
        buffer_parts = (
            ("datasource", meta["buffer_file"]) if "buffer_file" in meta
            else layout.datasource_parts(rollout_id, ".buffer.arrow")
        )
        self.buffer = groups_in_order(read_samples(layout.store, *buffer_parts))
        if len(self.buffer) != meta.get("buffer_groups", len(self.buffer)):
            raise ValueError(f"datasource {rollout_id}: buffer file does not match its state")
        self._order = self._epoch_order(self.state.epoch_id)
        return meta

    def reset(self) -> None:
        """Back to the state of a fresh run (used when resuming at step 0)."""
        self.state = DataSourceState()
        self.buffer = []
        self._order = self._epoch_order(0)
