"""slime's RolloutDataSourceWithBuffer, with the buffer's contents saved on every step.

Groups come from the buffer first (through the buffer filter; partial rollouts and
recycled groups wait there), then from the dataset, epoch by epoch, shuffled per epoch with a
seed derived from (seed, epoch). Each group is `n_samples_per_prompt` deep copies of one prompt with
consecutive global sample indices. The state (epoch, offset, counters, buffer) is saved per
rollout_id so a resumed run draws exactly the same groups as an uninterrupted one.

The dataset is a `PromptSource`: rows become Samples only when drawn (`take`), so the epoch
order is a numpy permutation of row numbers, not a list of prompts. A row the source drops
(a prompt too long for the model) is skipped and counted, and the draw goes on to the next.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from engines.hooks.loader import returned_groups
from storage.batch_io import read_samples, write_samples
from storage.run_layout import RunLayout
from storage.sample import Group, Sample, Status

BufferFilter = Callable[[Any, int, list[Group], int], list[Group]]


def pop_first(args: Any, rollout_id: int, buffer: list[Group], num_samples: int) -> list[Group]:
    """Default buffer filter: the oldest `num_samples` groups."""
    taken = buffer[:num_samples]
    del buffer[:num_samples]
    return taken


class PromptSource(Protocol):
    """Rows drawn by number (`engines.data.prompt_dataset.PromptDataset`, or a list of Samples)."""

    def __len__(self) -> int: ...

    def take(self, indices: Sequence[int] | np.ndarray) -> list[Sample | None]:
        """The Samples of rows `indices`, in order; None for a row the source drops."""
        ...


class SamplePrompts:
    """A list of Samples as a PromptSource (tests, and sets built in memory)."""

    def __init__(self, samples: Sequence[Sample]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def take(self, indices: Sequence[int] | np.ndarray) -> list[Sample | None]:
        return [self.samples[int(i)] for i in indices]


@dataclass
class DataSourceState:
    epoch_id: int = 0
    sample_offset: int = 0  # rows of this epoch's order consumed (drawn or dropped)
    sample_index: int = 0
    group_index: int = 0
    rollout_id: int = -1  # the step whose draws this state includes
    rows_dropped: int = 0  # rows skipped so far because the source dropped them


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Row numbers in the order epoch `epoch` draws them: a permutation seeded by a stable
    hash of (seed, epoch), the same in every process and on every resume."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    digest = hashlib.sha256(f"{seed}/{epoch}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little")).permutation(n)


def groups_in_order(samples: list[Sample]) -> list[Group]:
    """Regroup a flat list by group_index, keeping the order groups first appear in."""
    groups: dict[int, Group] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


class RolloutDataSourceWithBuffer:
    def __init__(
        self,
        prompts: PromptSource | Sequence[Sample],
        n_samples_per_prompt: int,
        seed: int = 42,
        shuffle: bool = True,
        buffer_filter: BufferFilter = pop_first,
        hook_args: Any = None,
    ) -> None:
        if not len(prompts):
            raise ValueError("the prompt dataset is empty")
        self.prompts: PromptSource = (
            SamplePrompts(prompts) if isinstance(prompts, Sequence) else prompts
        )
        self.n_samples_per_prompt = n_samples_per_prompt
        self.seed = seed
        self.shuffle = shuffle
        self.buffer_filter = buffer_filter
        self.hook_args = hook_args
        self.buffer: list[Group] = []
        self.state = DataSourceState()
        self._order_epoch = -1
        self._order = np.zeros(0, np.int64)

    # -- drawing -------------------------------------------------------------------------
    def _epoch_rows(self) -> np.ndarray:
        """This epoch's order, computed once per epoch (not on every state load)."""
        if self._order_epoch != self.state.epoch_id:
            self._order = epoch_order(len(self.prompts), self.seed, self.state.epoch_id,
                                      self.shuffle)
            self._order_epoch = self.state.epoch_id
        return self._order

    def _next_prompts(self, n: int) -> list[Sample]:
        out: list[Sample] = []
        misses = 0  # rows dropped since the last usable one
        while len(out) < n:
            if self.state.sample_offset >= len(self.prompts):
                self.state.epoch_id += 1
                self.state.sample_offset = 0
            start = self.state.sample_offset
            rows = self._epoch_rows()[start : start + n - len(out)]
            for prompt in self.prompts.take(rows):
                self.state.sample_offset += 1
                if prompt is None:
                    self.state.rows_dropped += 1
                    misses += 1
                else:
                    out.append(prompt)
                    misses = 0
            if misses >= len(self.prompts):
                raise ValueError(f"no usable prompt in {misses} rows drawn in a row: every "
                                 "row of the prompt set is dropped (too long for the model?)")
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
            groups = returned_groups(
                self.buffer_filter, "rollout.buffer_filter_path",
                self.buffer_filter(self.hook_args, rollout_id, self.buffer, num_groups),
            )
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
        save_source_state(layout, rollout_id, self.state, self.buffer, compression, stage, extra)

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
        return meta

    def reset(self) -> None:
        """Back to the state of a fresh run (used when resuming at step 0)."""
        self.state = DataSourceState()
        self.buffer = []


def save_source_state(
    layout: RunLayout,
    rollout_id: int,
    state: DataSourceState,
    buffer: Sequence[Group],
    compression: str | None = "zstd",
    stage: str = "sample_prompts",
    extra: dict[str, Any] | None = None,
) -> None:
    """`RolloutDataSourceWithBuffer.save` of a given state and buffer: async mode saves a
    snapshot of its generation loop (engines/rollout/async_producer.py), whose groups in
    flight and finished wait in the saved buffer."""
    buffer_name = f"{rollout_id:06d}.{stage}.buffer.arrow"
    flat = [s for g in buffer for s in g]
    write_samples(layout.store, flat, "datasource", buffer_name, compression=compression)
    meta = {
        **asdict(state),
        "buffer_groups": len(buffer),
        "buffer_file": buffer_name,
        "stage": stage,
        "extra": extra or {},
    }
    layout.store.write_json(meta, *layout.datasource_parts(rollout_id, ".json"))
