"""The cluster section: where the run's actors live and how they are placed."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from storage.config import Section


class ClusterConfig(Section):
    address: str | None = Field(
        None,
        description="Ray address to join; None starts (or reuses) a local head on demand.",
    )
    namespace: str = Field("rollflow", description="Ray namespace of every named actor.")
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of a local head started on demand."
    )
    num_gpus: int | None = Field(
        None, ge=0,
        description="GPUs of a local head started on demand (None: every GPU torch sees in "
        "the starting process, so CUDA_VISIBLE_DEVICES applies; 0 on a CPU-only machine).",
    )
    actor_num_threads: int | None = Field(
        None, ge=1,
        description="torch threads per actor (None: all cores of the machine, split among a "
        "CPU train group's ranks on one node; applied in each actor, because Ray starts an "
        "actor that reserves no CPU with OMP_NUM_THREADS=1).",
    )
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra Ray runtime_env of the run's actors (e.g. {py_modules: [...]} or "
        "{working_dir: ...} on a cluster without a shared filesystem). Actors always get the "
        "driver's working directory and PYTHONPATH on their PYTHONPATH, so hooks like "
        "`myreward:score` next to the config import in every actor.",
    )
    keep_actors: bool = Field(
        False,
        description="Keep the run's actors after the train flow succeeds (a failed run always "
        "keeps them, so a rerun attaches to warm engines and trainer). A later run without it "
        "frees them, also a rerun of the finished run.",
    )
    actor_num_nodes: int = Field(1, ge=1, description="Nodes of the train group (slime).")
    actor_num_gpus_per_node: int = Field(
        1, ge=1, description="GPUs (CPU-only: bundles) per node of the train group (slime)."
    )
    rollout_num_gpus: int | None = Field(
        None,
        ge=1,
        description="GPUs of the rollout engines; default: the train group's when colocated, "
        "else one engine's worth (rollout_num_gpus_per_engine).",
    )
    rollout_num_gpus_per_engine: int = Field(1, ge=1, description="GPUs of one engine (TP).")
    placement: Literal["auto", "always", "never"] = Field(
        "auto",
        description="Pin the train ranks and engines to the run's placement-group bundles "
        "(auto: only when the cluster has GPUs; on CPU-only machines actors otherwise take "
        "no CPU slot).",
    )
    colocate: bool = Field(
        False,
        description="Engines and trainer share the same bundles (offload/onload between "
        "phases); False splits the bundles at the rollout offset.",
    )

    @property
    def train_ranks(self) -> int:
        """The train group's ranks: actor_num_nodes x actor_num_gpus_per_node."""
        return self.actor_num_nodes * self.actor_num_gpus_per_node
