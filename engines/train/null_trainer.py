"""The trainer of `rollout.debug_rollout_only` runs: a null object with TrainActor's methods.

It holds no model, so a rollout-only run costs no trainer memory, and it stays at weight
version 0: the engines keep the weights they started with, every step "trains" as a
recorded no-op, and checkpoints are skipped. The flow and its tasks run unchanged.
"""

from __future__ import annotations

from typing import Any

from engines.config.run import RunConfig


class NullTrainActor:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def version(self) -> int:
        return 0

    def train(self, rollout_id: int) -> dict[str, float]:
        return {"skipped": 1.0, "debug_rollout_only": 1.0}

    def train_step(self, rollout_id: int) -> dict[str, float]:
        return self.train(rollout_id)

    def offload(self) -> None:
        """No model, nothing to free."""

    def onload(self) -> None:
        """No model, nothing to load."""

    def trained_indices(self) -> list[int]:
        return []

    def weights(self) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, rollout_id: int) -> str:
        return ""

    def ensure_version(self, target: int) -> dict[str, Any]:
        return {"rebuilt": False, "version": 0, "replayed": []}
