"""Optional metric sinks (TensorBoard, wandb) behind one interface.

`open_sinks(cfg, layout, run_name)` always returns a sink; with no sink configured it is a
`NullSink`, so callers log unconditionally -- no `if wandb:` branches (nanochat's DummyWandb).
Only numeric scalars are forwarded; the step is the rollout id, so a resumed run continues
its curves instead of restarting them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from flows.config.logging import LoggingConfig
from storage.run_layout import RunLayout


class MetricSink(Protocol):
    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries (bools and strings, e.g. checkpoint URIs, are not curves)."""
    return {
        k: float(v) for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


class NullSink:
    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        pass

    def close(self) -> None:
        pass


class FanOut:
    def __init__(self, sinks: list[MetricSink]) -> None:
        self.sinks = sinks

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(metrics, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class TensorBoardSink:
    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for key, value in scalars(metrics).items():
            if key != "rollout_id":
                self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One wandb run per rollflow run (its id is derived from the run name, so a resumed
    rollflow run appends to the same wandb run)."""

    def __init__(self, cfg: LoggingConfig, log_dir: str, run_name: str) -> None:
        import wandb

        os.makedirs(log_dir, exist_ok=True)
        self.run = wandb.init(
            project=cfg.wandb_project, name=run_name, id=re.sub(r"[^\w-]", "-", run_name),
            dir=log_dir, mode=cfg.wandb_mode, resume="allow",
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.run.log(scalars(metrics), step=step, commit=True)

    def close(self) -> None:
        self.run.finish()


def local_log_dir(configured: str | None, layout: RunLayout, run_name: str, sub: str) -> str:
    """`configured`, else beside the run when it is local, else ./<sub>/<run> (event files
    are appended to, which object stores do not do)."""
    if configured:
        return os.path.join(configured, run_name)
    if layout.store.protocol == "file":
        return layout.store.path(sub)
    return os.path.abspath(os.path.join(sub, run_name))


SinkFactory = Callable[[LoggingConfig, RunLayout, str], MetricSink]

SINKS: dict[str, SinkFactory] = {
    "tensorboard": lambda cfg, layout, run: TensorBoardSink(
        local_log_dir(cfg.tensorboard_dir, layout, run, "tensorboard")
    ),
    "wandb": lambda cfg, layout, run: WandbSink(
        cfg, local_log_dir(cfg.wandb_dir, layout, run, "wandb"), run
    ),
}


def open_sinks(cfg: LoggingConfig, layout: RunLayout, run_name: str) -> MetricSink:
    if not cfg.sinks:
        return NullSink()
    return FanOut([SINKS[name](cfg, layout, run_name) for name in cfg.sinks])
