"""Typed configuration: one section per component, each validated on construction.

Every component receives only its own section. The whole `RollflowConfig` is the `train`
flow's parameter, so the Prefect UI shows it for every run. Field descriptions double as the
reference documentation (`rollflow config --help` prints them).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from flows.secrets import (  # noqa: F401 - REDACTED, drop_redacted: the config's vocabulary
    REDACTED,
    drop_redacted,
    option_secrets,
    redact_options,
    redact_url,
    url_secrets,
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ClusterConfig(Section):
    address: str | None = Field(
        None,
        description="Ray address to join; None starts (or reuses) a local head on demand.",
    )
    namespace: str = Field("rollflow", description="Ray namespace of every named actor.")
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of a local head started on demand."
    )
    actor_num_threads: int | None = Field(
        None, ge=1, description="torch threads per actor (None: all cores of the machine)."
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
        "keeps them, so a rerun attaches to warm engines and trainer).",
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


class DataConfig(Section):
    prompt_data: str = Field(..., description="Training prompts: a .jsonl or .parquet file.")
    input_key: str = Field("prompt", description="Column/key holding the prompt.")
    label_key: str | None = Field("label", description="Column/key holding the label.")
    metadata_key: str | None = Field("metadata", description="Column/key with a metadata dict.")
    apply_chat_template: bool = Field(
        False, description="Render prompts through the tokenizer's chat template."
    )
    rollout_max_prompt_len: int | None = Field(
        None, ge=1,
        description="Drop prompts longer than this many tokens (at load time, counted); "
        "default: the model's context minus rollout.max_response_len.",
    )
    shuffle: bool = Field(True, description="Shuffle the dataset at every epoch.")
    seed: int = Field(42, description="Seed of the per-epoch shuffle.")


class RolloutConfig(Section):
    num_rollout: int = Field(..., ge=1, description="Rollout steps in the run.")
    rollout_batch_size: int = Field(..., ge=1, description="Groups (prompts) trained per step.")
    n_samples_per_prompt: int = Field(1, ge=1, description="Samples per prompt (group size).")
    over_sampling_batch_size: int | None = Field(
        None, ge=1, description="Groups submitted at a time (default: rollout_batch_size)."
    )
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k.")
    max_response_len: int = Field(64, ge=1, description="max_new_tokens of each request.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    seed: int = Field(1234, description="Base seed of sampling requests.")
    off_policy_async: bool = Field(
        False,
        description="One-step off-policy: generation of step k+1 overlaps training of step k "
        "(slime's train_async); weights are broadcast after each train step.",
    )
    max_staleness: int = Field(
        1, ge=0,
        description="Async mode: generation of step k waits until the engines hold weight "
        "version >= k - max_staleness (rounded down to a train.update_weights_interval push); "
        "buffered samples started on an older version are regenerated from the prompt and "
        "counted (rollout/groups_stale_regenerated_samples).",
    )
    function_path: str | None = Field(
        None,
        description="Custom rollout function `(args, rollout_id, data_source, evaluation)` "
        "(import string), e.g. an SFT rollout; None uses the generation loop.",
    )
    buffer_filter_path: str | None = Field(
        None, description="Buffer filter `(args, rollout_id, buffer, num_samples) -> groups`."
    )
    rm_type: str | None = Field(
        None,
        description="Built-in reward (rm hub): math, deepscaler, dapo, f1, exact_match, "
        "last_number, remote_rm; `boxed_<rule>` scores only the last \\boxed{...}.",
    )
    custom_rm_path: str | None = Field(
        None,
        description="Async reward fn `(args, sample) -> reward` (import string); with group_rm "
        "`(args, samples) -> list[reward]`.",
    )
    group_rm: bool = Field(
        False, description="Call custom_rm_path once per group with all its samples."
    )
    rm_url: str | None = Field(
        None, repr=False, description="remote_rm: URL receiving the JSON POST (a password in it is shown "
        "as REDACTED in config.yaml and the UI)."
    )
    rm_timeout_s: float = Field(30.0, gt=0.0, description="remote_rm: per-request timeout.")
    rm_max_retries: int = Field(
        5, ge=0, description="remote_rm: retries on timeouts, transport errors, 429 and 5xx."
    )
    rm_backoff_s: float = Field(
        1.0, ge=0.0, description="remote_rm: first retry delay, doubled each retry (cap 30 s)."
    )
    rm_rule_timeout_s: float = Field(
        10.0, gt=0.0,
        description="Deadline to grade one sample with a math rule (math, deepscaler, dapo and "
        "their boxed_ forms), which run in worker processes; past it the sample scores as a "
        "failure and counts in rollout/reward_timeouts.",
    )
    reward_key: str | None = Field(None, description="Key picked from dict rewards.")
    sglang_server_concurrency: int = Field(
        256, ge=1,
        description="In-flight generate requests per engine; the loop allows this times the "
        "number of engines (slime's semaphore).",
    )
    ignore_eos: bool = Field(
        False, description="Generate past EOS up to max_response_len (benchmarks, tests)."
    )
    use_router: bool = Field(
        True,
        description="Send requests through a supervised sglang-router process (False: "
        "round-robin straight to the engines).",
    )
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two", "manual"] = (
        Field("cache_aware", description="sglang-router load-balancing policy.")
    )
    dynamic_sampling_filter_path: str | None = Field(
        None,
        description="Dynamic-sampling filter `(args, group) -> bool` (import string or a "
        "tasks.filter_hub name, e.g. check_reward_nonzero_std); rejected groups are dropped.",
    )
    over_sampling_filter_path: str | None = Field(
        None,
        description="Over-sampling filter `(args, groups) -> groups` (import string or a "
        "tasks.filter_hub name, e.g. sort_by_reward_std). When set, generation keeps "
        "over_sampling_batch_size groups and the filter stage picks rollout_batch_size.",
    )
    custom_generate_function_path: str | None = Field(
        None,
        description="`async (args, sample, sampling_params) -> Sample` used per sample instead "
        "of the HTTP /generate call (multi-turn agents, tools).",
    )
    partial_rollout: bool = Field(
        False,
        description="Aborted groups go back to the buffer with their partial tokens and are "
        "continued later (False: they go back as fresh prompts).",
    )
    mask_offpolicy_in_partial_rollout: bool = Field(
        False,
        description="When a partial sample is continued, set the loss mask of the tokens an "
        "older policy generated to 0.",
    )
    max_groups_per_step: int | None = Field(
        None, ge=1,
        description="Dynamic sampling gives up after drawing this many groups in one step "
        "(None: 10 x the kept target) and trains on what it kept.",
    )
    debug_rollout_only: bool = Field(
        False, description="Generate and save rollouts but never train (no trainer actor)."
    )
    debug_train_only: bool = Field(
        False,
        description="Train on the saved train batches of debug_rollout_data; no engines.",
    )
    debug_rollout_data: str | None = Field(
        None,
        description="Run directory (path or URI) whose steps/{id}/train.arrow feed "
        "debug_train_only.",
    )

    @field_serializer("rm_url")
    def _redact_rm_url(self, url: str | None) -> str | None:
        return redact_url(url)

    @property
    def submit_batch_size(self) -> int:
        return self.over_sampling_batch_size or self.rollout_batch_size

    @model_validator(mode="after")
    def _check_rollout(self) -> RolloutConfig:
        if self.debug_rollout_only and self.debug_train_only:
            raise ValueError("rollout.debug_rollout_only and rollout.debug_train_only exclude "
                             "each other")
        if self.debug_train_only and not self.debug_rollout_data:
            raise ValueError("rollout.debug_train_only needs rollout.debug_rollout_data (the "
                             "run directory to train from)")
        if self.over_sampling_batch_size is not None and self.over_sampling_filter_path and (
            self.over_sampling_batch_size < self.rollout_batch_size
        ):
            raise ValueError("rollout.over_sampling_batch_size must be >= rollout_batch_size "
                             "when rollout.over_sampling_filter_path is set")
        return self


class EngineConfig(Section):
    backend: Literal["embedded", "sglang", "mock"] = Field(
        "embedded", description="Rollout engine: embedded (torch), sglang (HTTP), mock."
    )
    model_path: str | None = Field(None, description="HF-format model directory.")
    num_engines: int = Field(1, ge=1)
    host: str = Field("127.0.0.1", description="Interface the embedded HTTP server binds.")
    urls: list[str] = Field(
        default_factory=list, repr=False, description="External SGLang server URLs."
    )

    @field_serializer("urls")
    def _redact_urls(self, urls: list[str]) -> list[str]:
        return [redact_url(u) or u for u in urls]
    max_batch_size: int = Field(1024, ge=1, description="Requests decoded together.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    mock_response: str = Field(
        "", description="Mock backend: fixed answer template; '' echoes the label."
    )


class AlgorithmConfig(Section):
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = Field(
        "policy_loss", description="custom_loss calls `custom_loss_function_path`."
    )
    advantage_estimator: Literal[
        "grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"
    ] = Field("grpo", description="Advantage estimator (ppo trains a critic).")
    grpo_std_normalization: bool = Field(True, description="False gives Dr.GRPO.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount (ppo, reinforce++).")
    lambd: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda (ppo).")
    kl_coef: float = Field(
        0.0, ge=0.0, description="Reward shaping: per-token -kl_coef * KL(policy || ref)."
    )
    normalize_advantages: bool = Field(
        False, description="Whiten advantages over all masked tokens of the rollout batch."
    )
    eps_clip: float = Field(0.2, ge=0.0)
    eps_clip_high: float | None = Field(None, description="Clip-higher (default: eps_clip).")
    eps_clip_c: float | None = Field(
        None, gt=1.0, description="Dual-clip bound for negative advantages (> 1; None: off)."
    )
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0.0)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "low_var_kl", description="KL estimator of the KL loss and of kl_coef shaping."
    )
    entropy_coef: float = 0.0
    calculate_per_token_loss: bool = Field(
        False, description="False: slime's per-sample mean over response tokens."
    )
    use_rollout_logprobs: bool = Field(
        False, description="Use the engine's log-probs as the old policy (skip a forward)."
    )
    use_tis: bool = Field(
        False, description="Truncated importance sampling: weight pg by old/rollout ratio."
    )
    tis_clip: float = Field(2.0, gt=0.0, description="Upper truncation of the TIS weight.")
    tis_clip_low: float = Field(0.0, ge=0.0, description="Lower truncation of the TIS weight.")
    value_clip: float = Field(0.2, gt=0.0, description="PPO value-loss clip range.")
    use_opd: bool = Field(
        False, description="On-policy distillation: advantages -= opd_kl_coef * (student - teacher)."
    )
    opd_kl_coef: float = Field(1.0, ge=0.0, description="Weight of the distillation signal.")
    opd_teacher_path: str | None = Field(
        None, description="HF model directory of the distillation teacher (same vocabulary)."
    )
    custom_loss_function_path: str | None = Field(
        None,
        description="Import string `(algo_cfg, LossInputs, denominator) -> (loss, metrics)`.",
    )
    custom_advantage_function_path: str | None = Field(
        None,
        description="Import string `(algo_cfg, AdvantageInputs) -> (advantages, returns)`.",
    )

    @model_validator(mode="after")
    def _check_algorithm(self) -> AlgorithmConfig:
        if self.loss_type == "custom_loss" and not self.custom_loss_function_path:
            raise ValueError("algorithm.custom_loss_function_path is required by custom_loss")
        if self.use_opd and not self.opd_teacher_path:
            raise ValueError("algorithm.opd_teacher_path is required when use_opd is true")
        if self.use_tis and self.tis_clip_low > self.tis_clip:
            raise ValueError("algorithm.tis_clip_low must be <= algorithm.tis_clip")
        return self

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "ppo"


class TrainConfig(Section):
    backend: Literal["torch", "megatron", "mock"] = Field(
        "torch", description="torch (HF model, CPU/GPU), megatron (megatron-core, GPU only), mock."
    )
    tensor_parallel: int = Field(1, ge=1, description="megatron: tensor-parallel size.")
    pipeline_parallel: int = Field(1, ge=1, description="megatron: pipeline-parallel size.")
    model_path: str | None = Field(None, description="HF-format initial policy.")
    load: str | None = Field(None, description="Checkpoint directory (HF format) to start from.")
    critic_model_path: str | None = Field(
        None, description="HF model the critic backbone starts from (default: model_path)."
    )
    lr: float = Field(1e-6, gt=0.0)
    critic_lr: float | None = Field(None, description="Critic learning rate (default: lr).")
    lr_warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup.")
    lr_decay_style: Literal["constant", "cosine", "linear"] = "constant"
    lr_decay_steps: int | None = Field(
        None, ge=1, description="Optimizer steps (warmup included) until min_lr (cosine/linear)."
    )
    min_lr: float = Field(0.0, ge=0.0, description="Floor of the decayed learning rate.")
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.98)
    clip_grad: float = Field(1.0, gt=0.0)
    max_consecutive_skipped_steps: int = Field(
        5, ge=1,
        description="Optimizer steps skipped in a row for a non-finite gradient norm before "
        "the run fails (each skip is counted in train/skipped_steps).",
    )
    global_batch_size: int | None = Field(
        None, ge=1, description="Samples per optimizer step (default: the whole rollout batch)."
    )
    num_steps_per_rollout: int | None = Field(
        None, ge=1, description="Optimizer steps per rollout batch (sets global_batch_size)."
    )
    num_epochs_per_rollout: int = Field(1, ge=1, description="Passes over each rollout batch.")
    num_critic_only_steps: int = Field(
        0, ge=0, description="First N rollouts train only the critic (ppo)."
    )
    max_tokens_per_micro_batch: int = Field(16384, ge=1)
    save_interval: int | None = Field(
        None, ge=1, description="Checkpoint every N steps (None: only the last step)."
    )
    seed: int = 1234
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype; bfloat16 autocasts over float32 master weights."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda (this process's local rank) when available, else cpu."
    )
    weight_sync: Literal["tensor", "distributed", "disk"] = Field(
        "tensor",
        description="How new weights reach the engines: tensor (trainer -> Ray object store -> "
        "engine actors), distributed (pause, process-group broadcast in buckets, flush, continue), "
        "disk (save_pretrained + /update_weights_from_disk).",
    )
    update_weights_interval: int = Field(
        1, ge=1,
        description="Push new weights to the engines every N train steps (and after the last "
        "step, and before an evaluation); generation in between uses the last pushed version.",
    )
    update_weight_buffer_size: int = Field(
        512 * 1024**2, ge=1, description="Bytes per weight-update bucket (tensor/distributed)."
    )
    weight_sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend of distributed sync; auto: nccl on GPU, else gloo."
    )
    weight_sync_master_address: str = Field(
        "127.0.0.1", description="Address engines use to reach the trainer's (rank 0) TCPStore."
    )

    @model_validator(mode="after")
    def _check_train(self) -> TrainConfig:
        if self.global_batch_size is not None and self.num_steps_per_rollout is not None:
            raise ValueError("set train.global_batch_size or train.num_steps_per_rollout, not both")
        if self.lr_decay_style != "constant" and self.lr_decay_steps is None:
            raise ValueError(f"train.lr_decay_steps is required by lr_decay_style={self.lr_decay_style!r}")
        return self


RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


class StorageConfig(Section):
    uri: str = Field("./runs", description="Root of all runs: a path or s3://bucket/prefix.")
    run_name: str = Field(
        "run",
        description="Run directory under the root: letters, digits, '.', '_' and '-', starting "
        "with a letter or digit (so it stays inside the root and names actors and artifacts).",
    )
    endpoint_url: str | None = Field(
        None, repr=False, description="S3-compatible endpoint (MinIO, moto)."
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        repr=False,
        description="fsspec/s3fs options, e.g. {key, secret} or {profile}. They travel with "
        "the config to every actor; config.yaml, the Prefect UI and logs show every string "
        "value except harmless settings (profile, region_name, ...) as REDACTED, so a replay or "
        "a UI retry needs them again (prefer AWS_* env vars or instance credentials on every "
        "Ray node).",
    )
    compression: Literal["zstd", "lz4"] | None = "zstd"

    @field_validator("run_name")
    @classmethod
    def _safe_run_name(cls, name: str) -> str:
        if not re.fullmatch(RUN_NAME_PATTERN, name):
            raise ValueError(
                f"{name!r} must be 1-100 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit (it names a directory under storage.uri, actors and artifacts)"
            )
        return name

    @field_serializer("storage_options")
    def _redact(self, options: dict[str, Any]) -> dict[str, Any]:
        """Pickling (Ray) keeps the values; every dump (config.yaml, Prefect) hides them."""
        return redact_options(options)

    @field_serializer("endpoint_url")
    def _redact_endpoint(self, url: str | None) -> str | None:
        return redact_url(url)


class EvalDataset(Section):
    """One held-out set; unset sampling fields fall back to the rollout section's."""

    name: str = Field(..., description="Metric prefix: eval/{name}.")
    path: str = Field(..., description="A .jsonl or .parquet file.")
    input_key: str | None = Field(
        None, description="Column/key holding the prompt (default: data.input_key)."
    )
    label_key: str | None = Field(
        None, description="Column/key holding the label (default: data.label_key)."
    )
    metadata_key: str | None = Field(
        None,
        description="Column/key with a metadata dict, e.g. a per-row rm_type (default: "
        "data.metadata_key).",
    )
    apply_chat_template: bool | None = Field(
        None,
        description="Render prompts through the tokenizer's chat template (default: "
        "data.apply_chat_template).",
    )
    n_samples_per_eval_prompt: int = Field(1, ge=1, description="Samples per prompt.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Default: rollout.top_p.")
    top_k: int | None = Field(None, description="Default: rollout.top_k (-1 disables).")
    max_response_len: int | None = Field(None, ge=1, description="Default: rollout's.")
    stop: list[str] | None = Field(None, description="Stop strings (default: rollout's).")
    stop_token_ids: list[int] | None = Field(None, description="Default: rollout's.")
    rm_type: str | None = Field(None, description="Reward for this set (default: the run's).")
    custom_rm_path: str | None = Field(
        None, description="Async reward fn `(args, sample)` for this set (default: the run's)."
    )
    max_prompts: int | None = Field(None, ge=1, description="Use only the first N prompts.")


class EvalConfig(Section):
    datasets: list[EvalDataset] = Field(default_factory=list)
    eval_interval: int | None = Field(None, ge=1, description="Evaluate every N steps.")
    before_train: bool = Field(True, description="Evaluate the initial policy too.")

    @model_validator(mode="after")
    def _check_names(self) -> EvalConfig:
        names = [d.name for d in self.datasets]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"eval.datasets: names must be unique (repeated: {duplicates})")
        return self

    def inherit_data_keys(self, data: DataConfig) -> None:
        """Fill each dataset's unset row keys and chat-template flag from the data section,
        so an eval set shaped like the training set needs only name and path."""
        for ds in self.datasets:
            for key in ("input_key", "label_key", "metadata_key", "apply_chat_template"):
                if getattr(ds, key) is None:
                    object.__setattr__(ds, key, getattr(data, key))


class LoggingConfig(Section):
    level: str = "INFO"
    progress: bool = Field(True, description="tqdm bars in the CLI.")
    plot: bool = Field(True, description="Write reward/loss curve PNGs to the run directory.")
    plot_interval: int | None = Field(
        10, ge=1,
        description="A rollout step's flow run also shows the curves (image artifact) every N "
        "steps and at the last step; None: only the train flow, at the end.",
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
        urls = [self.rollout.rm_url, self.storage.endpoint_url, *self.engine.urls]
        found = option_secrets(self.storage.storage_options)
        for url in urls:
            found |= url_secrets(url)
        return found

    @model_validator(mode="after")
    def _check_cross_section(self) -> RollflowConfig:
        self.eval.inherit_data_keys(self.data)
        if self.engine.backend == "embedded" and not self.engine.model_path:
            self.engine.model_path = self.train.model_path
        if self.train.backend != "mock" and not (self.train.model_path or self.train.load):
            raise ValueError(f"train.model_path (or train.load) is required by the {self.train.backend} trainer")
        if self.engine.backend == "embedded" and not self.engine.model_path:
            raise ValueError("engine.model_path is required by the embedded engine")
        if self.engine.backend == "sglang" and self.train.weight_sync == "tensor":
            raise ValueError(
                "train.weight_sync: SGLang servers take weights over HTTP; use 'distributed' "
                "(process-group broadcast) or 'disk' with engine.backend 'sglang'"
            )
        unsupported = megatron_unsupported(self) if self.train.backend == "megatron" else []
        if unsupported:
            raise ValueError(
                "train.backend=megatron does not implement " + ", ".join(unsupported)
                + " (train.backend=torch does)"
            )
        if self.cluster.colocate and self.train.update_weights_interval > 1:
            raise ValueError(
                "train.update_weights_interval > 1 needs cluster.colocate=false: colocated "
                "engines release their weights during training and get them back by a push"
            )
        return self


def megatron_unsupported(cfg: RollflowConfig) -> list[str]:
    """The settings the megatron backend would otherwise silently ignore: it trains GRPO/GSPO
    policy or SFT losses (KL loss, entropy, clipping variants) at a constant learning rate."""
    a, t = cfg.algorithm, cfg.train
    checks = {
        f"algorithm.advantage_estimator={a.advantage_estimator}":
            a.advantage_estimator not in ("grpo", "gspo"),
        "algorithm.loss_type=custom_loss": a.loss_type == "custom_loss",
        "algorithm.custom_advantage_function_path": a.custom_advantage_function_path is not None,
        "algorithm.kl_coef (reward shaping)": a.kl_coef != 0.0,
        "algorithm.normalize_advantages": a.normalize_advantages,
        "algorithm.use_tis": a.use_tis,
        "algorithm.use_opd": a.use_opd,
        "train.lr_warmup_steps": t.lr_warmup_steps > 0,
        f"train.lr_decay_style={t.lr_decay_style}": t.lr_decay_style != "constant",
    }
    return [name for name, used in checks.items() if used]


class ConfigError(ValueError):
    """A config problem, with the dotted key(s) at fault in the message."""


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
