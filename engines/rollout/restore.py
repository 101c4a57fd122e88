"""Groups committed as they finish, and a rerun that takes them back instead of regenerating.

The generation loop tells a `StepLog` each draw from the data source and each group it is
done with (kept, dropped, failed, returned; in the loop or while draining after the abort).
`JournalLog` writes them, in that order, to the step's group journal (storage/group_journal.py).
A rerun of the step (driver, rollout actor, engine or machine lost) replays the journal
before generating (`replay`):

```
 journal:  draw(8) [g0 g3] [g1] draw(2) [g5 g2] ...  ┆ crash
 replay:   source.get_samples(8)  -> same groups, same cursor (checked)
           g0 g3 g1 ... restored with their stored samples and outcomes, in journal order
           the groups drawn but not in the journal are the in-flight ones: sent again
```
Why the rerun comes out as the uninterrupted step: the data source is restored to the state
sample_prompts left and draws are deterministic, so replaying the same draws (same sizes,
same order) hands out the same groups with the same group and sample indices, and leaves the
cursor where the crashed attempt had it; a sample's response depends only on its index and
the weights (`sampling_seed = rollout.seed + index`), so an in-flight group generated again
is the group the crashed attempt would have finished. Outcomes are replayed as recorded, not
recomputed, so a filter that is not a pure function of the group cannot change the past.
Where the step's outcome depends on the order groups finish (a dynamic filter or
over-sampling, which abort what is left once enough are kept), the rerun continues the
crashed attempt's order rather than starting a new one.

Draws that do not match the journal (the prompt data or a buffer filter changed) raise
`JournalMismatch`, and the caller regenerates the step from scratch, as it would without a
journal. A journal written under other generation settings is not replayed at all
(`settings_fingerprint`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, runtime_checkable

from engines.config.run import RunConfig
from storage.group_journal import GroupJournal, JournalEntry, encode_entry
from storage.sample import Group, Sample


class Outcome(StrEnum):
    """What the loop did with a group it is done with."""

    KEPT = "kept"  # trained (before the trim to the target)
    DROPPED = "dropped"  # finished, rejected by the dynamic filter
    FAILED = "failed"  # a sample failed
    RETURNED = "returned"  # came back unfinished in the loop: back to the buffer
    SURPLUS = "surplus"  # finished while draining, accepted: back to the buffer
    ABORTED = "aborted"  # unfinished when drained: back to the buffer (partial tokens)


LOOP, DRAIN = "loop", "drain"  # the phase a group came out in


class GroupSource(Protocol):
    def get_samples(self, num_groups: int) -> list[Group]: ...


@runtime_checkable
class CursorSource(GroupSource, Protocol):
    """A source that can say where it is, so a replayed draw can be checked."""

    def cursor(self) -> dict[str, Any]: ...


def cursor_of(source: GroupSource) -> dict[str, Any]:
    return source.cursor() if isinstance(source, CursorSource) else {}


class JournalMismatch(Exception):
    """The journal does not describe what this attempt draws: it cannot be replayed."""


class StepLog(Protocol):
    """Where the generation loop reports its draws and finished groups."""

    def drawn(self, num_groups: int, groups: Sequence[Group], cursor: dict[str, Any]) -> None: ...

    def finished(self, group: Group, outcome: Outcome, phase: str) -> None: ...

    def commit(self) -> None:
        """Store the groups `finished` reported since the last commit, as one entry."""
        ...

    async def flush(self) -> None: ...

    def metrics(self) -> dict[str, float]: ...


class NullLog:
    """No journal (`rollout.journal_groups` off, evaluation, tests)."""

    def drawn(self, num_groups: int, groups: Sequence[Group], cursor: dict[str, Any]) -> None:
        pass

    def finished(self, group: Group, outcome: Outcome, phase: str) -> None:
        pass

    def commit(self) -> None:
        pass

    async def flush(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}


class JournalLog:
    """Appends the loop's events to a step's journal: a draw as one entry, the groups the
    loop is done with at once (one `asyncio.wait`, or the drain) as one entry, so groups
    that a batched request finished together cost one file. Each entry is encoded in the
    loop's thread (a snapshot: a returned group is reset to its prompt afterwards) and
    written by one background thread, in order, so the event loop never waits on storage
    and the stored journal is always a prefix of the events."""

    def __init__(self, journal: GroupJournal, fingerprint: str, next_seq: int = 0) -> None:
        self.journal = journal
        self.fingerprint = fingerprint
        self._seq = next_seq
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="group-journal")
        self._writes: list[Future[float]] = []
        self._done: list[tuple[Group, Outcome, str]] = []
        self.encode_seconds = 0.0
        self.bytes = 0

    def drawn(self, num_groups: int, groups: Sequence[Group], cursor: dict[str, Any]) -> None:
        self._append({"kind": "draw", "n": num_groups, "fingerprint": self.fingerprint,
                      "groups": [g[0].group_index for g in groups],
                      "digest": groups_digest(groups), "cursor": cursor}, [])

    def finished(self, group: Group, outcome: Outcome, phase: str) -> None:
        self._done.append((group, outcome, phase))

    def commit(self) -> None:
        if not self._done:
            return
        done, self._done = self._done, []
        self._append({"kind": "groups", "groups": [
            {"group_index": g[0].group_index, "outcome": str(o), "phase": p} for g, o, p in done
        ]}, [s for g, _, _ in done for s in g])

    def _append(self, record: dict[str, Any], samples: list[Sample]) -> None:
        start = time.perf_counter()
        name, data = encode_entry(JournalEntry(self._seq, record, samples),
                                  self.journal.compression)
        self._seq += 1
        self.bytes += len(data)
        self.encode_seconds += time.perf_counter() - start
        self._writes.append(self._pool.submit(self._write, name, data))

    def _write(self, name: str, data: bytes) -> float:
        start = time.perf_counter()
        self.journal.write(name, data)
        return time.perf_counter() - start

    async def flush(self) -> None:
        """Wait for every write; raise the first that failed."""
        try:
            for write in self._writes:
                await asyncio.wrap_future(write)
        finally:
            self._pool.shutdown(wait=True)

    def metrics(self) -> dict[str, float]:
        done = [w.result() for w in self._writes if w.done() and w.exception() is None]
        return {"rollout/journal_entries": float(len(self._writes)),
                "rollout/journal_bytes": float(self.bytes),
                "rollout/journal_encode_seconds": self.encode_seconds,
                "rollout/journal_write_seconds": sum(done) + self.encode_seconds}


@dataclass
class Restored:
    """The loop's state after replaying a journal: what it had done when it stopped."""

    drawn: int = 0
    in_flight: list[Group] = field(default_factory=list)  # drawn, not done: sent again
    kept: list[Group] = field(default_factory=list)
    returned: list[Group] = field(default_factory=list)
    drained: list[tuple[Group, Outcome]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    groups: int = 0  # groups taken from the journal
    tokens: int = 0  # response tokens those groups hold
    next_seq: int = 0


def replay(entries: Sequence[JournalEntry], source: GroupSource, fingerprint: str) -> Restored:
    """Draw from `source` as the journal's attempt did and take back its finished groups."""
    out = Restored()
    if entries and entries[0].record.get("fingerprint") != fingerprint:
        raise JournalMismatch("written under other generation settings")
    in_flight: dict[int, Group] = {}
    for entry in entries:
        rec = entry.record
        if rec["kind"] == "draw":
            groups = source.get_samples(int(rec["n"]))
            got = [g[0].group_index for g in groups]
            if (got != rec["groups"] or groups_digest(groups) != rec["digest"]
                    or cursor_of(source) != rec["cursor"]):
                raise JournalMismatch(f"draw {entry.seq} gave groups {got[:4]}..., the "
                                      f"journal has {rec['groups'][:4]}...")
            out.drawn += len(groups)
            in_flight.update((g[0].group_index, g) for g in groups)
            continue
        stored_groups: dict[int, Group] = {}
        for s in entry.samples:
            stored_groups.setdefault(s.group_index, []).append(s)
        for item in rec["groups"]:
            gi = int(item["group_index"])
            drawn, stored = in_flight.pop(gi, None), stored_groups.get(gi, [])
            if drawn is None or [s.index for s in drawn] != [s.index for s in stored]:
                raise JournalMismatch(f"entry {entry.seq}: group {gi} was not drawn as the "
                                      "journal has it")
            out.groups += 1
            out.tokens += sum(s.response_length for s in stored)
            outcome = Outcome(item["outcome"])
            if item["phase"] == DRAIN:
                out.drained.append((stored, outcome))
            elif outcome == Outcome.KEPT:
                out.kept.append(stored)
            elif outcome == Outcome.RETURNED:
                out.returned.append(stored)
            else:
                out.counts[outcome] = out.counts.get(outcome, 0) + 1
    out.in_flight = list(in_flight.values())
    out.next_seq = entries[-1].seq + 1 if entries else 0
    return out


def groups_digest(groups: Sequence[Group]) -> str:
    """What a draw handed out: indices and token ids (group indices alone would not show
    other prompt data, or a shuffle under another seed)."""
    h = hashlib.sha256()
    for g in groups:
        for s in g:
            h.update(json.dumps([s.index, s.group_index, s.tokens]).encode())
    return h.hexdigest()[:16]


def settings_fingerprint(cfg: RunConfig) -> str:
    """What a journal's groups depend on: the rollout, data and engine sections (less the
    run's length, the journal switch and the engine count, which change no group)."""
    sections = {
        "rollout": cfg.rollout.model_dump(mode="json", exclude={"num_rollout", "journal_groups"}),
        "data": cfg.data.model_dump(mode="json"),
        "engine": cfg.engine.model_dump(mode="json", exclude={"num_engines"}),
    }
    return hashlib.sha256(json.dumps(sections, sort_keys=True, default=str).encode()).hexdigest()[:16]
