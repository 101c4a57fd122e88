"""A step's group journal: what `generate` has finished so far, one small file per entry, so a
crash in the middle of generation loses only the groups still in flight.

```
{run}/steps/{rollout_id:06d}/groups/{seq:06d}.{sha256[:16]}.arrow
```
An entry is one Arrow IPC file: the samples of the groups it records (none for a draw) and, in the
schema's metadata under `rollflow.journal`, a small JSON record (what kind of entry, the
group's outcome, the data-source cursor after a draw). What the records mean is the
generation loop's business (engines/rollout/restore.py); this module only stores them.

Why one file per entry rather than one growing file: object stores cannot append, and a file
written whole is atomic everywhere (`ObjectStore.write_bytes`: temporary name, then moved
into place; one PUT on S3), so an entry is either there complete or not there at all. The
name carries the file's digest, so a file changed after it was written (a disk fault, a
truncating copy) is caught where it is read, without a second file per entry to hold it.

Entries are replayed in order and each depends on those before it (a group entry on the
draw that produced its group), so the journal is read up to the first entry that is missing,
duplicated or damaged; what follows it is ignored and regenerated.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

from storage.arrow_schema import samples_to_table, table_to_samples
from storage.batch_io import table_to_ipc_bytes
from storage.object_store import ObjectStore
from storage.sample import Sample

log = logging.getLogger(__name__)

JOURNAL_DIR = "groups"
_META_KEY = b"rollflow.journal"
_NAME = re.compile(r"^(\d{6})\.([0-9a-f]{16})\.arrow$")


@dataclass(frozen=True, slots=True)
class JournalEntry:
    seq: int
    record: dict[str, Any]
    samples: list[Sample] = field(default_factory=list)


def encode_entry(entry: JournalEntry, compression: str | None = "lz4") -> tuple[str, bytes]:
    """(file name, bytes) of an entry. Pure CPU, so the caller can take a snapshot of a
    group in its event loop and leave the write to another thread."""
    table = samples_to_table(entry.samples)
    meta = {**(table.schema.metadata or {}), _META_KEY: json.dumps(entry.record).encode()}
    data = table_to_ipc_bytes(table.replace_schema_metadata(meta), compression)
    return f"{entry.seq:06d}.{hashlib.sha256(data).hexdigest()[:16]}.arrow", data


def decode_entry(seq: int, data: bytes) -> JournalEntry:
    table = ipc.open_file(pa.BufferReader(data)).read_all()
    raw = (table.schema.metadata or {}).get(_META_KEY)
    if raw is None:
        raise ValueError("no journal record in the file's metadata")
    return JournalEntry(seq, json.loads(raw), table_to_samples(table))


class GroupJournal:
    """The journal of one step, under `steps/{k}/groups/` of a run's store."""

    def __init__(self, store: ObjectStore, step: str, compression: str | None = "lz4") -> None:
        self.store = store
        self.parts = (step, JOURNAL_DIR)
        self.compression = compression

    def write(self, name: str, data: bytes) -> None:
        # No fsync: the digest in the name tells a complete file from one a lost machine
        # left short, and the journal is read only up to such a file.
        self.store.write_bytes(data, *self.parts, name, sync=False)

    def append(self, entry: JournalEntry) -> None:
        self.write(*encode_entry(entry, self.compression))

    def entries(self) -> list[JournalEntry]:
        """The entries in order, up to the first one missing, duplicated or damaged."""
        names: dict[int, list[tuple[str, str]]] = {}
        for name in self.store.list(*self.parts):
            m = _NAME.match(name)
            if m is not None:  # temporaries of an interrupted write do not match
                names.setdefault(int(m.group(1)), []).append((name, m.group(2)))
        out: list[JournalEntry] = []
        for seq in range(len(names) + 1):
            found = names.get(seq, [])
            if len(found) != 1:
                if found or seq < max(names, default=-1):
                    log.warning("%s: journal entry %06d is %s; ignoring it and the %d after it",
                                self.store.uri(*self.parts), seq,
                                "written twice" if found else "missing",
                                sum(1 for s in names if s > seq))
                break
            name, digest = found[0]
            entry = self._read(seq, name, digest)
            if entry is None:
                break
            out.append(entry)
        return out

    def _read(self, seq: int, name: str, digest: str) -> JournalEntry | None:
        uri = self.store.uri(*self.parts, name)
        try:
            data = self.store.read_bytes(*self.parts, name)
            if hashlib.sha256(data).hexdigest()[:16] != digest:
                raise ValueError("sha256 differs from the one in its name")
            return decode_entry(seq, data)
        except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as exc:
            log.warning("%s: damaged journal entry (%s); replaying only the %d before it",
                        uri, exc, seq)
            return None

    def clear(self) -> None:
        self.store.delete(*self.parts)
