"""Keys and contents of the Prefect artifacts the tasks and flows publish (progress bars,
tables, curves): keyed per run, so two trainings on one server never share an artifact, and
numbers rounded for people (a table of 16-digit floats is hard to read)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, cast
from uuid import UUID

from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tasks.artifact_sender import send_artifact


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


class ProgressArtifact:
    """A Prefect progress artifact created by its first `set` and updated by the later ones;
    a value equal to the last one shown is not sent again (a wait may poll it every 0.5 s).
    Sent through `send_artifact`, so in a training's background thread, in order."""

    def __init__(self, key: str, description: str) -> None:
        self.key, self.description = key, description
        self._id: UUID | None = None
        self._last: float | None = None

    def set(self, percent: float) -> None:
        if percent == self._last:
            return
        self._last = percent
        send_artifact(self._send, percent)

    def _send(self, percent: float) -> None:
        if self._id is None:
            self._id = cast(UUID, create_progress_artifact(
                percent, key=self.key, description=self.description))
        else:
            update_progress_artifact(self._id, percent)


def for_people(value: Any, digits: int = 4) -> Any:
    """A float to `digits` significant digits (0.123456789 -> 0.1235); anything else as is.
    The run directory keeps the exact values."""
    if isinstance(value, float) and math.isfinite(value) and value != 0.0:
        return float(f"{value:.{digits}g}")
    return value


def rounded_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: for_people(v) for k, v in row.items()} for row in rows]


def eval_rows(weight_version: int, metrics: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per held-out metric (`eval/test`: accuracy for 0/1 rewards)."""
    return [{"weight_version": weight_version, "metric": k, "value": for_people(v)}
            for k, v in sorted(metrics.items())
            if isinstance(v, int | float) and not isinstance(v, bool)]


def in_a_run() -> bool:
    """Inside a Prefect flow or task run: outside one (a unit test calling `task.fn`) there
    is no run page to show an artifact on, and creating one would start a Prefect server."""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def publish_eval(run_name: str, weight_version: int, metrics: Mapping[str, Any]) -> None:
    """Table `{run}-eval`, one version of it per evaluated weight version."""
    if not in_a_run():
        return
    send_artifact(
        create_table_artifact,
        eval_rows(weight_version, metrics), key=artifact_key(run_name, "eval"),
        description=f"held-out metrics of run {run_name} at weight version {weight_version}",
    )
