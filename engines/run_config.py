"""The run config as engines see it: a read-only view of the component sections.

`flows/config.py` composes the sections into `RollflowConfig`, and nothing below `flows/`
may import it (imports run flows -> tasks -> engines -> storage). Code handed the whole run
config types it with this Protocol instead: actor creation and naming (`engines/cluster/`),
the rollout manager, and the `args` of user hooks (slime hands its hooks its whole argument
namespace; rollflow hands them the run config, read through this view). Components that
read fewer sections declare a narrower view beside them (`TrainActorConfig`,
`ScheduleConfig`); `RollflowConfig` satisfies every one of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the section types only: this view imports no component at run time
    from engines.algorithms.config import AlgorithmConfig
    from engines.cluster.config import ClusterConfig
    from engines.data.config import DataConfig
    from engines.inference.config import EngineConfig
    from engines.rollout.config import EvalConfig, RolloutConfig
    from engines.train.config import TrainConfig
    from storage.config import StorageConfig

# The sections the run's actors are built from, in the run config's order (`logging` is the
# driver's alone).
ACTOR_SECTIONS = ("cluster", "data", "rollout", "engine", "algorithm", "train", "storage", "eval")


class RunConfig(Protocol):
    """Every section an actor may read; `logging` stays with the driver."""

    @property
    def cluster(self) -> ClusterConfig: ...
    @property
    def data(self) -> DataConfig: ...
    @property
    def rollout(self) -> RolloutConfig: ...
    @property
    def engine(self) -> EngineConfig: ...
    @property
    def algorithm(self) -> AlgorithmConfig: ...
    @property
    def train(self) -> TrainConfig: ...
    @property
    def storage(self) -> StorageConfig: ...
    @property
    def eval(self) -> EvalConfig: ...
