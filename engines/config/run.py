"""The run config as engines see it: a read-only view of the component sections.

`flows/config/run.py` composes the sections into `RollflowConfig`, and nothing below `flows/`
may import it (imports run flows -> tasks -> engines -> storage). Code handed the whole run
config types it with this Protocol instead: actor creation and naming (`engines/cluster/`),
the rollout manager, the train actor, the weight schedule, and the `args` of user hooks
(slime hands its hooks its whole argument namespace; rollflow hands them the run config,
read through this view). A component built from one section takes that section's class.
"""

from __future__ import annotations

from typing import Protocol

from engines.config.algorithm import AlgorithmConfig
from engines.config.cluster import ClusterConfig
from engines.config.data import DataConfig
from engines.config.engine import EngineConfig
from engines.config.rollout import EvalConfig, RolloutConfig
from engines.config.train import TrainConfig
from storage.config import StorageConfig

# The sections the run's actors are built from, in the run config's order (`logging` is the
# driver's alone).
ACTOR_SECTIONS = ("cluster", "data", "rollout", "engine", "algorithm", "train", "storage", "eval")


class RunConfig(Protocol):
    """Every section an actor may read; `logging` stays with the driver."""

    cluster: ClusterConfig
    data: DataConfig
    rollout: RolloutConfig
    engine: EngineConfig
    algorithm: AlgorithmConfig
    train: TrainConfig
    storage: StorageConfig
    eval: EvalConfig
