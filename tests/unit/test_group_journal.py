"""The step's group journal: its storage format (atomic entries, digests in the names, read up
to the first bad entry) and the rerun it allows: replaying any prefix of an uninterrupted
step's journal and generating the rest gives that step again, sending only what was in
flight. No Ray: a deterministic fake engine in the event loop."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Sequence
from typing import Any

import pytest

from engines.config.rollout import RolloutConfig
from engines.data.data_source import RolloutDataSourceWithBuffer
from engines.rollout.generation import RolloutResult, build_generation_loop
from engines.rollout.restore import (
    JournalLog,
    JournalMismatch,
    replay,
)
from engines.rollout.rollout_manager import StepDataSource
from engines.rollout.sglang_client import GenerateOutput
from storage.group_journal import GroupJournal, JournalEntry
from storage.object_store import ObjectStore
from storage.sample import Sample, Status

FINGERPRINT = "f" * 16


# -- storage format --------------------------------------------------------------------------
def sample(i: int, gi: int) -> Sample:
    s = Sample(index=i, group_index=gi, prompt=f"p{gi}", tokens=[1, 2, 3])
    s.append_response([7, 8], [-0.5, -0.25], "78")
    s.status, s.reward = Status.COMPLETED, 1.0
    return s


def journal(tmp_path) -> GroupJournal:
    return GroupJournal(ObjectStore(str(tmp_path)), "steps/000000")


def test_entries_round_trip_in_order(tmp_path):
    j = journal(tmp_path)
    j.append(JournalEntry(0, {"kind": "draw", "n": 2}))
    j.append(JournalEntry(1, {"kind": "groups", "groups": [0]}, [sample(0, 0), sample(1, 0)]))
    got = journal(tmp_path).entries()
    assert [e.record for e in got] == [{"kind": "draw", "n": 2}, {"kind": "groups", "groups": [0]}]
    assert got[1].samples == [sample(0, 0), sample(1, 0)] and got[0].samples == []
    j.clear()
    assert journal(tmp_path).entries() == []


def test_the_journal_is_read_up_to_its_first_bad_entry(tmp_path):
    j = journal(tmp_path)
    for seq in range(5):
        j.append(JournalEntry(seq, {"seq": seq}, [sample(seq, seq)]))
    folder = tmp_path / "steps/000000/groups"
    names = sorted(os.listdir(folder))
    (folder / f"{names[4]}.tmp-1234abcd").write_bytes(b"half")  # an interrupted write: ignored
    assert len(j.entries()) == 5

    data = (folder / names[3]).read_bytes()
    (folder / names[3]).write_bytes(data[: len(data) // 2])  # truncated after it was written
    assert [e.seq for e in j.entries()] == [0, 1, 2]
    (folder / names[3]).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # one bit flipped
    assert [e.seq for e in j.entries()] == [0, 1, 2]
    (folder / names[3]).write_bytes(data)
    shutil.copy(folder / names[1], folder / f"000001.{'0' * 16}.arrow")  # seq 1 twice
    assert [e.seq for e in j.entries()] == [0]
    os.remove(folder / f"000001.{'0' * 16}.arrow")
    os.remove(folder / names[2])  # a gap
    assert [e.seq for e in j.entries()] == [0, 1]


# -- replay through the generation loop ------------------------------------------------------
class FakeEngines:
    """A Dispatch whose tokens depend only on the sampling seed (as a real engine's on its
    seed and weights), whose group finishes after a number of turns of the event loop set by its index (so groups
    finish out of order), and which aborts what is in flight on abort_all with half its
    tokens. Counts the groups it was asked to generate."""

    num_engines = 1
    per_sample = False

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.aborted = False

    async def generate(self, input_ids: list[list[int]], params: list[dict[str, Any]],
                       rids: list[str]) -> Sequence[GenerateOutput]:
        index = int(rids[0].split("-")[1])
        self.sent.append(index)
        for _ in range(index % 5 * 3 + 20 * (index % 7 == 3)):
            await asyncio.sleep(0)
        outs = []
        for p in params:
            seed, budget = p["sampling_seed"], p["max_new_tokens"]
            ids = [(seed * 7 + k) % 11 for k in range(budget)]
            reason = "abort" if self.aborted else "stop"
            if self.aborted:
                ids = ids[: budget // 2]
            outs.append(GenerateOutput(ids, " ".join(map(str, ids)), [-0.25] * len(ids),
                                       {"type": reason}, 0))
        return outs

    async def abort_all(self) -> None:
        self.aborted = True


def prompts(n: int) -> list[Sample]:
    return [Sample(index=-1, group_index=-1, prompt=f"p{i}", tokens=[1, 2, 3 + i])
            for i in range(n)]


async def reward(args: Any, s: Sample) -> float:
    return float(s.response_tokens[0] % 2)


def keep_mixed(args: Any, group: list[Sample]) -> bool:
    return len({s.reward for s in group}) > 1


CONFIGS = {
    "plain": dict(rollout_batch_size=6, n_samples_per_prompt=3, max_response_len=4),
    "filter-oversample-partial": dict(
        rollout_batch_size=4, over_sampling_batch_size=6, n_samples_per_prompt=3,
        max_response_len=4, partial_rollout=True),
}


def run_step(cfg: RolloutConfig, root, entries: list[JournalEntry] | None = None,
             dynamic: bool = False) -> tuple[RolloutResult, FakeEngines, StepDataSource]:
    """One step from a fresh data source (the state sample_prompts leaves), replaying
    `entries` first when given, journaling to `root`."""
    data = RolloutDataSourceWithBuffer(prompts(40), n_samples_per_prompt=cfg.n_samples_per_prompt)
    first = data.get_samples(cfg.submit_batch_size)
    source = StepDataSource(first, data, 0)
    restored = replay(entries, source, FINGERPRINT) if entries else None
    engines = FakeEngines()
    loop = build_generation_loop(cfg, engines, reward, target=cfg.rollout_batch_size,
                                 dynamic_filter=keep_mixed if dynamic else None)
    log = JournalLog(journal(root), FINGERPRINT, restored.next_seq if restored else 0)
    result = asyncio.run(loop.run_dynamic(source, log, restored))
    data.add_samples(result.returned + source.unused())
    return result, engines, source


def outcome_of(result: RolloutResult) -> tuple[Any, ...]:
    counts = {k: v for k, v in result.counts.items()
              if k not in ("restored", "resumed_samples")}
    return ([s for g in result.kept for s in g], [s for g in result.returned for s in g], counts)


def finished_in(entries: list[JournalEntry]) -> list[tuple[dict[str, Any], list[Sample]]]:
    """Each group the entries record as done: (its item in the record, its samples)."""
    return [(item, [s for s in e.samples if s.group_index == item["group_index"]])
            for e in entries if e.record["kind"] == "groups" for item in e.record["groups"]]


def cuts(tmp_path, cfg: RolloutConfig, entries: list[JournalEntry], dynamic: bool):
    """Rerun the step from each prefix of `entries`, as a crash after that entry leaves it."""
    for cut in range(1, len(entries) + 1):
        prefix = entries[:cut]
        for entry in prefix:
            journal(tmp_path / f"cut{cut}").append(entry)
        again, engines, source = run_step(cfg, tmp_path / f"cut{cut}", prefix, dynamic)
        restored = [item["group_index"] for item, _ in finished_in(prefix)]
        assert again.counts["restored"] == len(restored)
        # nothing the journal holds is generated again
        assert not set(restored) & {i // cfg.n_samples_per_prompt for i in engines.sent}
        rerun = journal(tmp_path / f"cut{cut}").entries()
        assert rerun[:cut] == prefix  # the rerun appends to the journal it replayed
        yield cut, prefix, again, source, rerun


def test_a_rerun_from_any_prefix_of_the_journal_is_the_uninterrupted_step(tmp_path):
    cfg = RolloutConfig(num_rollout=1, seed=5, **CONFIGS["plain"])
    full, engines, source = run_step(cfg, tmp_path / "full")
    entries = journal(tmp_path / "full").entries()
    assert len(finished_in(entries)) == len(set(engines.sent))
    assert full.counts["restored"] == 0 and full.stats.tokens_regenerated == 0
    assert full.metrics()["rollout/journal_entries"] == len(entries)
    for cut, prefix, again, source_again, rerun in cuts(tmp_path, cfg, entries, False):
        assert outcome_of(again) == outcome_of(full), f"cut after entry {cut}"
        assert source_again.cursor() == source.cursor()
        # the journal holds the whole step again (what was in flight may finish in
        # another order)
        assert sorted(str(item) for item, _ in finished_in(rerun)) == sorted(
            str(item) for item, _ in finished_in(entries))
        drawn = {gi for e in prefix if e.record["kind"] == "draw" for gi in e.record["groups"]}
        in_flight = drawn - {item["group_index"] for item, _ in finished_in(prefix)}
        assert again.stats.tokens_regenerated == sum(
            s.response_length for g in again.kept if g[0].group_index in in_flight for s in g)
        assert again.stats.tokens_restored == sum(
            s.response_length for e in prefix for s in e.samples)


def test_a_rerun_under_a_dynamic_filter_keeps_the_journal_as_it_happened(tmp_path):
    """With a dynamic filter and over-sampling, which groups a step keeps depends on the order
    they finish, on any engine; a rerun continues the crashed attempt's order: every group
    the journal holds comes back with its samples and its outcome, and what both runs
    generated is the same."""
    cfg = RolloutConfig(num_rollout=1, seed=5, **CONFIGS["filter-oversample-partial"])
    full, _, _ = run_step(cfg, tmp_path / "full", dynamic=True)
    assert full.counts["dropped"] and full.counts["aborted"]  # filters, aborts, returns
    entries = journal(tmp_path / "full").entries()
    finished_full = {g[0].group_index: g for g in full.kept}
    for _cut, prefix, again, _, _ in cuts(tmp_path, cfg, entries, True):
        assert len(again.kept) == cfg.rollout_batch_size
        kept = {g[0].group_index: g for g in again.kept}
        back = {g[0].group_index: g for g in again.returned}
        for item, samples in finished_in(prefix):
            gi, outcome = item["group_index"], item["outcome"]
            if outcome == "kept" and gi in kept:  # (the trim to the target may cut it)
                assert kept[gi] == samples
            elif outcome in ("returned", "aborted"):
                assert back[gi] == samples
            else:
                assert gi not in kept
        for gi, g in kept.items():
            if gi in finished_full:
                assert g == finished_full[gi]


def test_a_journal_of_other_draws_or_settings_is_not_replayed(tmp_path):
    cfg = RolloutConfig(num_rollout=1, **CONFIGS["plain"])
    run_step(cfg, tmp_path / "full")
    entries = journal(tmp_path / "full").entries()
    data = RolloutDataSourceWithBuffer(prompts(40), n_samples_per_prompt=3, seed=99)
    source = StepDataSource(data.get_samples(cfg.submit_batch_size), data, 0)
    with pytest.raises(JournalMismatch, match="draw 0"):
        replay(entries, source, FINGERPRINT)
    with pytest.raises(JournalMismatch, match="settings"):
        replay(entries, source, "0" * 16)
