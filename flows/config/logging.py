"""The `logging` section: the driver's alone (levels, progress bars, curves, step flow runs
and the metric sinks of flows/bookkeeping/metric_sinks.py); no actor reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from storage.config import Section


class LoggingConfig(Section):
    """The logging section: levels, progress bars, curves and the optional metric sinks."""

    level: str = "INFO"
    progress: bool = Field(True, description="tqdm bars in the CLI.")
    plot: bool = Field(True, description="Write reward/loss curve PNGs to the run directory.")
    plot_interval: int | None = Field(
        10, ge=1,
        description="The steps also show the curves (markdown artifact, PNG inlined) every N "
        "steps and at the last step; None: only the train flow, at the end.",
    )
    step_flow_runs: bool = Field(
        True,
        description="Run each rollout step as a child flow run of its own, "
        "`{run}/rollout-{id}` (the design card's shape): the runs list shows every step with "
        "its state, duration, logs and one graph of its tasks. Off: the step's tasks run in "
        "the train flow run, named `rollout-{id}/<task>`, at a lower cost per step "
        "(bench/RESULTS.md, 'Orchestration'), but the UI stops drawing the train run's graph "
        "past the server's 10,000 nodes (~1,400 steps, ~1,000 in async mode).",
    )
    sinks: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="Where step metrics also go, each optional: tensorboard (event files), "
        "wandb (offline by default, no network needed).",
    )
    tensorboard_dir: str | None = Field(
        None,
        description="Local directory of the TensorBoard events; None: <run dir>/tensorboard "
        "for a local run, ./tensorboard/<run> for an s3:// run.",
    )
    wandb_project: str = Field("rollflow", description="wandb project.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline writes under wandb_dir; `wandb sync` uploads later."
    )
    wandb_dir: str | None = Field(
        None, description="Local directory of wandb files; None: same rule as tensorboard_dir."
    )
