"""Typed configuration: one section per component, each validated on construction.

Every component receives only its own section. The whole `RollflowConfig` is the `train`
flow's parameter, so the Prefect UI shows it for every run. Field descriptions double as the
reference documentation (`rollflow config --help` prints them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ClusterConfig(Section):
    address: str | None = Field(
        None,
        description="Ray address to join; None starts (or reuses) a local head on demand.",
    )
    namespace: str = Field("rollflow", description="Ray namespace of every named actor.")
    num_cpus: int | None = Field(None, description="CPUs of a local head started on demand.")
    actor_num_threads: int | None = Field(
        None, description="torch threads per actor (None: all cores of the machine)."
    )
    keep_actors: bool = Field(
        False,
        description="Keep the run's actors after the train flow succeeds (a failed run always "
        "keeps them, so a rerun attaches to warm engines and trainer).",
    )


class DataConfig(Section):
    prompt_data: str = Field(..., description="Training prompts: a .jsonl or .parquet file.")
    input_key: str = Field("prompt", description="Column/key holding the prompt.")
    label_key: str | None = Field("label", description="Column/key holding the label.")
    metadata_key: str | None = Field("metadata", description="Column/key with a metadata dict.")
    apply_chat_template: bool = Field(
        False, description="Render prompts through the tokenizer's chat template."
    )
    rollout_max_prompt_len: int | None = Field(
        None, description="Drop prompts longer than this many tokens (at load time)."
    )
    shuffle: bool = Field(True, description="Shuffle the dataset at every epoch.")
    seed: int = Field(42, description="Seed of the per-epoch shuffle.")


class RolloutConfig(Section):
    num_rollout: int = Field(..., ge=1, description="Rollout steps in the run.")
    rollout_batch_size: int = Field(..., ge=1, description="Groups (prompts) trained per step.")
    n_samples_per_prompt: int = Field(1, ge=1, description="Samples per prompt (group size).")
    over_sampling_batch_size: int | None = Field(
        None, description="Groups submitted at a time (default: rollout_batch_size)."
    )
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 disables top-k.")
    max_response_len: int = Field(64, ge=1, description="max_new_tokens of each request.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    seed: int = Field(1234, description="Base seed of sampling requests.")
    function_path: str | None = Field(
        None,
        description="Custom rollout function `(args, rollout_id, data_source, evaluation)` "
        "(import string), e.g. an SFT rollout; None uses the generation loop.",
    )
    buffer_filter_path: str | None = Field(
        None, description="Buffer filter `(args, rollout_id, buffer, num_samples) -> groups`."
    )
    rm_type: str | None = Field(None, description="Built-in reward (rm hub), e.g. exact_match.")
    custom_rm_path: str | None = Field(None, description="Async reward fn `(args, sample)`.")
    reward_key: str | None = Field(None, description="Key picked from dict rewards.")
    concurrency: int = Field(256, ge=1, description="In-flight HTTP requests per engine.")

    @property
    def submit_batch_size(self) -> int:
        return self.over_sampling_batch_size or self.rollout_batch_size


class EngineConfig(Section):
    backend: Literal["embedded", "sglang", "mock"] = Field(
        "embedded", description="Rollout engine: embedded (torch), sglang (HTTP), mock."
    )
    model_path: str | None = Field(None, description="HF-format model directory.")
    num_engines: int = Field(1, ge=1)
    host: str = Field("127.0.0.1", description="Interface the embedded HTTP server binds.")
    urls: list[str] = Field(default_factory=list, description="External SGLang server URLs.")
    max_batch_size: int = Field(1024, ge=1, description="Requests decoded together.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    mock_response: str = Field(
        "", description="Mock backend: fixed answer template; '' echoes the label."
    )


class AlgorithmConfig(Section):
    loss_type: Literal["policy_loss", "sft_loss"] = "policy_loss"
    advantage_estimator: Literal["grpo"] = "grpo"
    grpo_std_normalization: bool = Field(True, description="False gives Dr.GRPO.")
    eps_clip: float = Field(0.2, ge=0.0)
    eps_clip_high: float | None = Field(None, description="Clip-higher (default: eps_clip).")
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0.0)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coef: float = 0.0
    calculate_per_token_loss: bool = Field(
        False, description="False: slime's per-sample mean over response tokens."
    )
    use_rollout_logprobs: bool = Field(
        False, description="Use the engine's log-probs as the old policy (skip a forward)."
    )


class TrainConfig(Section):
    backend: Literal["torch", "mock"] = "torch"
    model_path: str | None = Field(None, description="HF-format initial policy.")
    load: str | None = Field(None, description="Checkpoint directory (HF format) to start from.")
    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.98)
    clip_grad: float = Field(1.0, gt=0.0)
    global_batch_size: int | None = Field(
        None, description="Samples per optimizer step (default: the whole rollout batch)."
    )
    num_epochs_per_rollout: int = Field(1, ge=1, description="Passes over each rollout batch.")
    max_tokens_per_micro_batch: int = Field(16384, ge=1)
    save_interval: int | None = Field(None, description="Checkpoint every N steps.")
    seed: int = 1234
    dtype: Literal["float32", "bfloat16"] = "float32"


class StorageConfig(Section):
    uri: str = Field("./runs", description="Root of all runs: a path or s3://bucket/prefix.")
    run_name: str = Field("run", description="Run directory under the root.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto).")
    storage_options: dict[str, Any] = Field(default_factory=dict)
    compression: Literal["zstd", "lz4"] | None = "zstd"


class EvalDataset(Section):
    name: str
    path: str
    input_key: str = "prompt"
    label_key: str = "label"
    n_samples_per_eval_prompt: int = 1
    temperature: float = 0.0
    max_response_len: int | None = None
    max_prompts: int | None = None


class EvalConfig(Section):
    datasets: list[EvalDataset] = Field(default_factory=list)
    eval_interval: int | None = Field(None, description="Evaluate every N steps.")
    before_train: bool = Field(True, description="Evaluate the initial policy too.")


class LoggingConfig(Section):
    level: str = "INFO"
    progress: bool = Field(True, description="tqdm bars in the CLI.")
    plot: bool = Field(True, description="Write reward/loss curve PNGs to the run directory.")


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

    @model_validator(mode="after")
    def _check_cross_section(self) -> RollflowConfig:
        if self.engine.backend == "embedded" and not self.engine.model_path:
            self.engine.model_path = self.train.model_path
        if self.train.backend == "torch" and not (self.train.model_path or self.train.load):
            raise ValueError("train.model_path (or train.load) is required by the torch trainer")
        if self.engine.backend == "embedded" and not self.engine.model_path:
            raise ValueError("engine.model_path is required by the embedded engine")
        if self.engine.backend == "sglang" and not self.engine.urls:
            raise ValueError("engine.urls must list the SGLang servers for backend 'sglang'")
        return self


class ConfigError(ValueError):
    """A config problem, with the dotted key(s) at fault in the message."""


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(root)"
        lines.append(f"  {key}: {e['msg']}")
    return "invalid config:\n" + "\n".join(lines)
