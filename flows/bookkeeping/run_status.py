"""Where a run stands, read from its run directory alone, for `rollflow runs list|show`:
running, failed (with its one-line cause), complete, or stopped, and the command that
resumes it. The Prefect UI shows the same states from the flow runs; the run directory is
what the CLI has without a Prefect server.

    DRIVER.json's process alive            -> running
    FAILED on the first uncommitted steps  -> failed (its cause), or stopped if interrupted
    logs/error-*.log newer than the driver -> failed (its cause: preflight, actor start-up)
    every step committed                   -> complete
    otherwise                              -> stopped (killed, Ctrl-C before a step)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml

from flows.bookkeeping.driver_record import read_record
from storage.run_layout import RunLayout

# the driver writes a log per failed command (flows/cli/errors.py): its first line is the
# command, its second the cause
LOGS = "logs"


@dataclass(frozen=True)
class RunStatus:
    state: str  # running | failed | complete | stopped
    committed: int  # steps committed
    num_rollout: int | None  # steps the run is configured for (None: no config.yaml)
    cause: str | None = None  # a failed run's one-line cause
    command: str | None = None  # the command that failed, as the user typed it

    def steps(self) -> str:
        total = "" if self.num_rollout is None else f"/{self.num_rollout}"
        return f"{self.committed}{total}"


def headline_metric(loss_type: str | None) -> str:
    """The figure a person follows for a step (`algorithm.loss_type`): SFT has no reward
    (its steps report 0), so its loss."""
    return "train/loss" if loss_type == "sft_loss" else "reward/mean"


def loss_type_of(config: dict[str, Any] | None) -> str | None:
    """`algorithm.loss_type` of a saved config.yaml."""
    return ((config or {}).get("algorithm") or {}).get("loss_type")


def saved_config(layout: RunLayout) -> dict[str, Any] | None:
    if not layout.store.exists("config.yaml"):
        return None
    loaded = yaml.safe_load(layout.store.read_text("config.yaml"))
    return loaded if isinstance(loaded, dict) else None


def newest_error_log(layout: RunLayout) -> tuple[float, str, str] | None:
    """(written at, command, cause) of the run's newest error log, or None."""
    names = [n for n in layout.store.list(LOGS) if n.startswith("error-") and n.endswith(".log")]
    if not names:
        return None
    name = names[-1]  # error-<YYYYmmdd-HHMMSS-micro>.log: the names sort by time
    lines = layout.store.read_text(LOGS, name).splitlines()
    info = layout.store.fs.info(layout.store.path(LOGS, name))
    written = float(info.get("mtime") or info.get("created") or 0.0)
    command = lines[0] if lines else ""
    cause = lines[1] if len(lines) > 1 else "(an empty log)"
    return written, command, cause


def run_status(layout: RunLayout, lookahead: int = 4) -> RunStatus:
    config = saved_config(layout)
    num_rollout = ((config or {}).get("rollout") or {}).get("num_rollout")
    num_rollout = int(num_rollout) if num_rollout is not None else None
    committed = layout.next_rollout_id()
    driver = read_record(layout)
    if driver is not None and driver.running():
        return RunStatus("running", committed, num_rollout)
    last = committed + lookahead if num_rollout is None else min(committed + lookahead,
                                                                  num_rollout)
    for k in range(committed, last):
        failure = layout.failure(k)
        if failure is not None:
            cause = failure.get("cause") or str(failure.get("error", "")).split("\n", 1)[0]
            state = "stopped" if failure.get("interrupted") else "failed"
            return RunStatus(state, committed, num_rollout, f"step {k}: {cause}")
    log = newest_error_log(layout)
    if log is not None and (driver is None or log[0] > driver.written_at):
        return RunStatus("failed", committed, num_rollout, log[2], log[1])
    if num_rollout is not None and committed >= num_rollout:
        return RunStatus("complete", committed, num_rollout)
    return RunStatus("stopped", committed, num_rollout)


def resume_command(layout: RunLayout, status: RunStatus) -> str | None:
    """What to run to go on: the saved config resumes at the first uncommitted step (run
    from the directory the run was started in, where its hooks import from); a run that
    never saved one reruns the command that failed."""
    if status.state in ("running", "complete"):
        return None
    if layout.store.exists("config.yaml"):
        if layout.store.protocol != "file":  # --config takes a local file
            return (f"the `rollflow train` command that started it (its config is saved "
                    f"as {layout.store.uri('config.yaml')})")
        return f"rollflow train --config {layout.store.uri('config.yaml')}"
    if status.command and status.command.startswith("rollflow train"):
        return status.command
    return None


def is_run(layout: RunLayout) -> bool:
    """A run directory: a saved config, or the log of a run that failed before saving one."""
    return layout.store.exists("config.yaml") or bool(layout.store.list(LOGS))

