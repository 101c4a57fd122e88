"""Where everything of one run lives in object storage (DESIGN.md, "Run layout").

```
{run}/config.yaml
{run}/steps/{rollout_id:06d}/prompts.arrow | rollout.arrow | train.arrow | metrics.json
{run}/steps/{rollout_id:06d}/tasks/{task}.json      (each finished task's small output)
{run}/steps/{rollout_id:06d}/COMMITTED
{run}/datasource/{rollout_id:06d}.json + {rollout_id:06d}.{stage}.buffer.arrow
{run}/checkpoints/{rollout_id:06d}/...  and  {run}/checkpoints/LATEST
{run}/eval/{rollout_id:06d}.json
```
A step is done only when its COMMITTED marker exists; the marker is written last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from storage.object_store import ObjectStore, open_store


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
        return self.store.exists(step_dir(rollout_id), "COMMITTED")

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
        self.store.write_json({"committed_at": time.time()}, step_dir(rollout_id), "COMMITTED")

    def mark_failed(self, rollout_id: int, error: str) -> None:
        """Tells other flow runs waiting on this step to stop waiting (async mode)."""
        self.store.write_json({"failed_at": time.time(), "error": error}, step_dir(rollout_id), "FAILED")

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

    def step_metrics(self, rollout_id: int) -> dict[str, Any]:
        parts = (step_dir(rollout_id), "metrics.json")
        return self.store.read_json(*parts) if self.store.exists(*parts) else {}

    # -- data source state ---------------------------------------------------------------
    def datasource_parts(self, rollout_id: int, suffix: str) -> tuple[str, str]:
        return "datasource", f"{rollout_id:06d}{suffix}"

    # -- checkpoints ---------------------------------------------------------------------
    def checkpoint_parts(self, rollout_id: int) -> tuple[str, str]:
        return "checkpoints", f"{rollout_id:06d}"

    def latest_checkpoint(self) -> int | None:
        """Rollout id whose checkpoint LATEST points at (weights after that step)."""
        if not self.store.exists("checkpoints", "LATEST"):
            return None
        return int(self.store.read_text("checkpoints", "LATEST").strip())

    def set_latest_checkpoint(self, rollout_id: int) -> None:
        self.store.write_text(str(rollout_id), "checkpoints", "LATEST")

    # -- eval ----------------------------------------------------------------------------
    def save_eval(self, rollout_id: int, metrics: dict[str, Any]) -> None:
        self.store.write_json(metrics, "eval", f"{rollout_id:06d}.json")

    def evals(self) -> dict[int, dict[str, Any]]:
        out = {}
        for name in self.store.list("eval"):
            if name.endswith(".json"):
                out[int(name[:6])] = self.store.read_json("eval", name)
        return out
