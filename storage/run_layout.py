"""Where everything of one run lives in object storage (DESIGN.md, "Run layout").

```
{run}/config.yaml
{run}/steps/{rollout_id:06d}/prompts.arrow | rollout.arrow | train.arrow | metrics.json
{run}/steps/{rollout_id:06d}/tasks/{task}.json      (each finished task's small output)
{run}/steps/{rollout_id:06d}/groups/...               (generate's group journal, until it commits:
                                                       group_journal.py)
{run}/steps/{rollout_id:06d}/COMMITTED                (size + sha256 of every file above)
{run}/datasource/{rollout_id:06d}.json + {rollout_id:06d}.{stage}.buffer.arrow
{run}/checkpoints/{rollout_id:06d}/... MANIFEST.json  and  {run}/checkpoints/LATEST
{run}/eval/{rollout_id:06d}.json
{run}/settings/{digest}.json      (train settings, named by each step's tasks/train.json)
```
A step is done only when its COMMITTED marker exists; the marker is written last and
records each file's size and sha256, which every batch read checks (`integrity.py`).

A checkpoint is complete when its MANIFEST.json exists and every file it lists is there with
the recorded size. Its files are uploaded first and its manifest last, into a directory
cleared of any earlier unfinished save, and a complete checkpoint is never rewritten
(`prepare_checkpoint`): so a reader sees a checkpoint whole or not at all, whenever the writer
was killed. LATEST, written after the manifest, is a hint: without it, or when it points at
an incomplete checkpoint, the newest complete one is found by scanning (with a warning).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from storage.integrity import (
    MANIFEST_FILE,
    SEAL_FILE,
    CorruptFileError,
    check_dir,
    dir_manifest,
    manifest_to_json,
    read_manifest,
    write_manifest,
)
from storage.object_store import ObjectStore, open_store
from storage.step_signals import step_state_written

log = logging.getLogger(__name__)

# In a run directory while the run's actors outlive it (`cluster.keep_actors`), so that a
# later rerun without keep_actors knows there is something to free even when it has no step
# left to run (and otherwise would not connect to Ray at all); `runs stop` removes it.
ACTORS_KEPT = "ACTORS_KEPT"


def step_dir(rollout_id: int) -> str:
    return f"steps/{rollout_id:06d}"


@dataclass
class RunLayout:
    store: ObjectStore  # rooted at the run directory

    @classmethod
    def open(
        cls,
        uri: str,
        run_name: str,
        endpoint_url: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> RunLayout:
        root = open_store(uri, endpoint_url, **(storage_options or {}))
        return cls(root.child(run_name))

    @property
    def uri(self) -> str:
        return self.store.root

    # -- steps ---------------------------------------------------------------------------
    def step_file(self, rollout_id: int, name: str) -> tuple[str, str]:
        return step_dir(rollout_id), name

    def is_committed(self, rollout_id: int) -> bool:
        return self.store.exists(step_dir(rollout_id), SEAL_FILE)

    def committed_steps(self) -> list[int]:
        steps = []
        for name in self.store.list("steps"):
            if name.isdigit() and self.is_committed(int(name)):
                steps.append(int(name))
        return steps

    def next_rollout_id(self) -> int:
        """First step not yet committed; steps commit in order, so that is count-based."""
        done = set(self.committed_steps())
        k = 0
        while k in done:
            k += 1
        return k

    def mark_committed(self, rollout_id: int) -> None:
        """Seal the step: the marker lists the size and sha256 of every file of the step
        (read back once; a few batch files), so later reads detect truncation or change."""
        d = step_dir(rollout_id)
        files = dir_manifest(self.store, d, skip=(SEAL_FILE, "FAILED"))
        record = {"committed_at": time.time(), "files": manifest_to_json(files)}
        self.store.write_json(record, d, SEAL_FILE)
        step_state_written()

    def mark_failed(self, rollout_id: int, error: str, cause: str | None = None,
                    interrupted: bool = False) -> None:
        """Tells other flow runs waiting on this step to stop waiting (async mode), and
        `rollflow runs list|show` why the run stopped: `cause` in one line, `interrupted`
        for Ctrl-C or SIGTERM (a stopped run, not a failed one)."""
        record = {"failed_at": time.time(), "error": error, "cause": cause or error,
                  "interrupted": interrupted}
        self.store.write_json(record, step_dir(rollout_id), "FAILED")
        step_state_written()

    def failure(self, rollout_id: int) -> dict[str, Any] | None:
        parts = (step_dir(rollout_id), "FAILED")
        return self.store.read_json(*parts) if self.store.exists(*parts) else None

    def clear_failure(self, rollout_id: int) -> None:
        self.store.delete(step_dir(rollout_id), "FAILED")

    # -- per-task outputs (the resume keys: run, rollout_id, task) -------------------------
    def task_record(self, rollout_id: int, task: str) -> dict[str, Any] | None:
        parts = (step_dir(rollout_id), "tasks", f"{task}.json")
        return self.store.read_json(*parts) if self.store.exists(*parts) else None

    def save_task_record(self, rollout_id: int, task: str, record: dict[str, Any]) -> None:
        self.store.write_json(record, step_dir(rollout_id), "tasks", f"{task}.json")
        step_state_written()

    def save_train_settings(self, settings: dict[str, Any], digest: str) -> None:
        """Store the settings steps train under, once per distinct settings (`digest` is
        their content hash); a step's train record names them as `settings`."""
        if not self.store.exists("settings", f"{digest}.json"):
            self.store.write_json(settings, "settings", f"{digest}.json")

    def train_settings_digest(self, rollout_id: int) -> str | None:
        """The digest of the settings step `rollout_id` was trained under, if its train
        record names them (runs from before settings were recorded do not)."""
        digest = (self.task_record(rollout_id, "train") or {}).get("settings")
        return digest if isinstance(digest, str) else None

    def train_settings(self, digest: str, rollout_id: int) -> dict[str, Any]:
        """The settings stored as `digest` (named by step `rollout_id`, for the error)."""
        parts = ("settings", f"{digest}.json")
        if not self.store.exists(*parts):
            raise CorruptFileError(self.store.uri(*parts),
                                   f"missing (step {rollout_id} was trained under it)")
        return dict(self.store.read_json(*parts))

    def train_settings_of(self, rollout_id: int) -> dict[str, Any] | None:
        """The settings step `rollout_id` was trained under, if its train record names them."""
        digest = self.train_settings_digest(rollout_id)
        return None if digest is None else self.train_settings(digest, rollout_id)

    def step_metrics(self, rollout_id: int) -> dict[str, Any]:
        parts = (step_dir(rollout_id), "metrics.json")
        return self.store.read_json(*parts) if self.store.exists(*parts) else {}

    # -- data source state ---------------------------------------------------------------
    def datasource_parts(self, rollout_id: int, suffix: str) -> tuple[str, str]:
        return "datasource", f"{rollout_id:06d}{suffix}"

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint_parts(self, rollout_id: int) -> tuple[str, str]:
        return "checkpoints", f"{rollout_id:06d}"

    def checkpoint_problems(
        self, rollout_id: int, checksums: bool = False
    ) -> list[CorruptFileError]:
        """Why checkpoint `rollout_id` is not complete (empty if it is): no manifest (saving
        did not finish), a listed file missing or of another size (one listing), or, with
        `checksums`, a file whose sha256 differs (reads the whole checkpoint)."""
        parts = self.checkpoint_parts(rollout_id)
        manifest = read_manifest(self.store, *parts)
        if manifest is None:
            uri = self.store.uri(*parts, MANIFEST_FILE)
            return [CorruptFileError(uri, "missing or unreadable (saving did not finish)")]
        return check_dir(self.store, manifest, *parts, checksums=checksums)

    def latest_checkpoint(self, before: int | None = None) -> int | None:
        """Rollout id of the newest complete checkpoint (weights after that step), only ids
        `< before` if given: LATEST's if it is complete; else, with a warning, the newest
        complete one older than it (LATEST missing: the newest complete one at all).

        Checkpoints newer than LATEST are passed over: LATEST moves right after a checkpoint
        is stored, so they belong to a save that did not finish. A checkpoint without a
        manifest counts only where LATEST points at it (runs from before manifests)."""
        pointer = self._latest_pointer()
        saved = sorted((int(n) for n in self.store.list("checkpoints") if n.isdigit()),
                       reverse=True)
        if pointer is None and saved:
            log.warning("%s: no checkpoints/LATEST; looking for the newest complete checkpoint",
                        self.uri)
        elif pointer is not None and pointer not in saved:
            log.warning("%s: checkpoints/LATEST points at %06d, which is gone; trying older ones",
                        self.uri, pointer)
        for k in saved:
            if (before is not None and k >= before) or (pointer is not None and k > pointer):
                continue
            if k == pointer and not self.store.exists(*self.checkpoint_parts(k), MANIFEST_FILE):
                return k
            problems = self.checkpoint_problems(k)
            if not problems:
                return k
            log.warning("checkpoint %06d is not complete (%s); trying an older one",
                        k, "; ".join(str(p) for p in problems[:3]))
        return None

    def _latest_pointer(self) -> int | None:
        if not self.store.exists("checkpoints", "LATEST"):
            return None
        text = self.store.read_text("checkpoints", "LATEST").strip()
        if not text.isdigit():
            log.warning("%s: checkpoints/LATEST holds %r; ignoring it", self.uri, text[:40])
            return None
        return int(text)

    def prepare_checkpoint(self, rollout_id: int) -> bool:
        """Before saving checkpoint `rollout_id`: True if it is already stored whole (sizes
        and sha256 match its manifest; a rerun's commit saving it again), then it is kept as
        it is: rewriting a complete checkpoint in place would, killed halfway, leave the new
        manifest over old files or mix two saves of weights that need not be bit-identical.
        Otherwise what is there is what a save that did not finish left (or a corrupted
        copy): LATEST moves off it to the newest complete older one, and it is deleted, so
        that the new save's files are the only ones its manifest (written last) can vouch for.
        """
        parts = self.checkpoint_parts(rollout_id)
        if not self.store.exists(*parts):
            return False
        pointer = self._latest_pointer()
        legacy = pointer == rollout_id and not self.store.exists(*parts, MANIFEST_FILE)
        if legacy or not self.checkpoint_problems(rollout_id, checksums=True):
            return True
        if pointer == rollout_id:
            older = self.latest_checkpoint(before=rollout_id)
            if older is None:
                self.store.delete("checkpoints", "LATEST")
            else:
                self.store.write_text(str(older), "checkpoints", "LATEST")
        self.store.delete(*parts)
        return False

    def set_latest_checkpoint(self, rollout_id: int) -> None:
        """Point LATEST at a stored checkpoint, after making sure it is complete. A backend
        that wrote no MANIFEST.json gets one from the stored files (read back once)."""
        parts = self.checkpoint_parts(rollout_id)
        manifest = read_manifest(self.store, *parts)
        if manifest is None:
            write_manifest(self.store, dir_manifest(self.store, *parts), *parts)
        else:
            problems = check_dir(self.store, manifest, *parts)
            if problems:
                raise problems[0]
        self.store.write_text(str(rollout_id), "checkpoints", "LATEST")

    # -- eval ----------------------------------------------------------------------------
    def save_eval(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        self.store.write_json(metrics, "eval", _eval_file(rollout_id))

    def has_eval(self, rollout_id: int) -> bool:
        return self.store.exists("eval", _eval_file(rollout_id))

    def eval_of(self, weight_version: int) -> dict[str, Any] | None:
        """One version's stored held-out metrics (one read, where `evals` reads them all)."""
        if not self.has_eval(weight_version):
            return None
        return dict(self.store.read_json("eval", _eval_file(weight_version)))

    def evals(self) -> dict[int, dict[str, Any]]:
        out = {}
        for name in self.store.list("eval"):
            if name.endswith(".json"):
                out[int(name[:6])] = self.store.read_json("eval", name)
        return out


def _eval_file(weight_version: int) -> str:
    return f"{weight_version:06d}.json"
