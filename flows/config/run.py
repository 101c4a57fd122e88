"""The run config: the components' sections composed, checked across sections, defaults
resolved.

Each section is its component's class, with field docs and checks beside it: `cluster`,
`data`, `rollout`, `eval`, `engine`, `algorithm` and `train` in engines/config/ (a module
per section); `storage` in storage/config.py; `logging` in flows/bookkeeping/metric_sinks.py.
Engines read the run config through `engines.config.run.RunConfig`, never this module.
The whole `RollflowConfig` is the `train` flow's parameter, so the Prefect UI shows it for
every run; field descriptions double as the reference (`rollflow config --help`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from engines.config.algorithm import AlgorithmConfig
from engines.config.cluster import ClusterConfig
from engines.config.data import DataConfig
from engines.config.engine import EngineConfig
from engines.config.rollout import EvalConfig, EvalDataset, RolloutConfig, is_environment_uri
from engines.config.train import TrainConfig, check_parallel_sizes
from flows.config.logging import LoggingConfig
from storage.config import ConfigError, Section, StorageConfig
from storage.secrets import REDACTED, drop_redacted, option_secrets, url_secrets

# The sections and the config vocabulary, importable from one place.
__all__ = [
    "REDACTED", "AlgorithmConfig", "ClusterConfig", "ConfigError",
    "DataConfig", "EngineConfig", "EvalConfig", "EvalDataset", "LoggingConfig",
    "RollflowConfig", "RolloutConfig", "Section", "StorageConfig", "TrainConfig",
    "dotted_key", "drop_redacted", "format_validation_error",
]


class RollflowConfig(Section):
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    data: DataConfig
    rollout: RolloutConfig
    engine: EngineConfig = Field(default_factory=EngineConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    def secret_values(self) -> set[str]:
        """Every value the dumps hide: storage options and URL credentials."""
        judge = self.rollout.judge
        urls = [self.rollout.rm_url, self.storage.endpoint_url, *self.engine.urls,
                judge.base_url if judge else None]
        found = option_secrets(self.storage.storage_options)
        for url in urls:
            found |= url_secrets(url)
        return found

    @model_validator(mode="before")
    @classmethod
    def _environment_prompts(cls, values: Any) -> Any:
        """`rollout.environment` alone names the prompts too: data.prompt_data defaults to
        its URI (its 'train' tasks)."""
        if not isinstance(values, dict):
            return values
        rollout = values.get("rollout")
        env = (rollout.get("environment") if isinstance(rollout, dict)
               else getattr(rollout, "environment", None))
        data = values.get("data", {})
        if env and isinstance(data, dict) and data.get("prompt_data") is None:
            values = {**values, "data": {**data, "prompt_data": env}}
        return values

    @model_validator(mode="after")
    def _check_cross_section(self) -> RollflowConfig:
        self.eval.inherit_data_keys(self.data)
        env = self.rollout.environment
        if env and not is_environment_uri(self.data.prompt_data):
            raise ValueError(
                f"rollout.environment plays the tasks of an environment, but data.prompt_data "
                f"names {self.data.prompt_data!r}, whose rows carry no task of it; leave "
                f"data.prompt_data unset (it defaults to {env!r}) or name an environment")
        if self.engine.backend == "embedded" and not self.engine.model_path:
            self.engine.model_path = self.train.model_path
        if self.engine.batch_invariant is None:  # (train.deterministic's half in the engine)
            self.engine.batch_invariant = self.train.deterministic
        if self.train.backend != "mock" and not (self.train.model_path or self.train.load):
            raise ValueError(f"train.model_path (or train.load) is required by the {self.train.backend} trainer")
        if self.engine.backend == "embedded" and not self.engine.model_path:
            raise ValueError("engine.model_path is required by the embedded engine")
        if (self.engine.backend == "sglang" and self.train.weight_sync == "tensor"
                and not self.cluster.colocate):
            raise ValueError(
                "train.weight_sync: 'tensor' reaches SGLang servers as CUDA IPC handles, which "
                "needs them on the trainer's GPU (cluster.colocate: true); use 'distributed' "
                "(process-group broadcast) or 'disk' with engine.backend 'sglang'"
            )
        if self.train.backend == "megatron":
            world = self.cluster.train_ranks
            check_parallel_sizes(world, self.train.tensor_parallel, self.train.pipeline_parallel,
                                 self.train.expert_parallel)
        if self.train.context_parallel > 1:
            self._check_context_parallel()
        if self.engine.expert_parallel > 1 and (
                self.cluster.rollout_num_gpus_per_engine % self.engine.expert_parallel):
            raise ValueError(
                f"engine.expert_parallel={self.engine.expert_parallel} must divide "
                f"cluster.rollout_num_gpus_per_engine={self.cluster.rollout_num_gpus_per_engine}"
                " (SGLang splits an engine's experts over its tensor-parallel GPUs)"
            )
        if self.algorithm.routing_replay and self.rollout.use_router:
            raise ValueError(
                "algorithm.routing_replay needs rollout.use_router: false: sglang-router 0.3.x "
                "drops return_routed_experts from the /generate requests it forwards, so the "
                "engines would record no routing"
            )
        if self.algorithm.needs_groups and self.rollout.n_samples_per_prompt < 2:
            raise ValueError(
                f"rollout.n_samples_per_prompt: 1 sample per prompt gives every advantage 0 "
                f"with algorithm.advantage_estimator={self.algorithm.advantage_estimator!r}, "
                "which compares the samples of one prompt with each other, so nothing is "
                "learnt; set rollout.n_samples_per_prompt to 2 or more (e.g. 8), or use an "
                "estimator without groups (reinforce_plus_plus, ppo)"
            )
        if self.train.lr_decay_style != "constant" and self.train.lr_decay_steps is None:
            # decay over the whole run, as TRL's and HF's schedules do by default
            samples = self.rollout.rollout_batch_size * self.rollout.n_samples_per_prompt
            self.train.lr_decay_steps = (
                self.rollout.num_rollout * self.train.optimizer_steps_per_rollout(samples))
        if self.cluster.colocate and self.train.update_weights_interval > 1:
            raise ValueError(
                "train.update_weights_interval > 1 needs cluster.colocate=false: colocated "
                "engines release their weights during training and get them back by a push"
            )
        return self

    def _check_context_parallel(self) -> None:
        """`train.context_parallel` divides the train ranks, and the run has no critic."""
        size = self.train.context_parallel
        world = self.cluster.train_ranks
        if world % size:
            raise ValueError(
                f"train.context_parallel={size} does not divide the {world} train ranks "
                "(cluster.actor_num_nodes x cluster.actor_num_gpus_per_node)"
            )
        if self.algorithm.uses_critic:
            raise ValueError(
                f"train.context_parallel={size} with a PPO critic (algorithm.advantage_estimator="
                f"{self.algorithm.advantage_estimator}): not supported; the critic's values are "
                "computed on unsplit rows"
            )


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        lines.append(f"  {dotted_key(e['loc'])}: {e['msg'].removeprefix('Value error, ')}")
    return "invalid config:\n" + "\n".join(lines)


def dotted_key(loc: tuple[Any, ...] | list[Any]) -> str:
    """('eval', 'datasets', 0, 'path') -> 'eval.datasets[0].path', as a user writes it."""
    key = ""
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    return key or "(root)"
