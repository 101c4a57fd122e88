"""The train section: backend, model, optimizer, batching, checkpoints and weight sync."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from storage.config import Section


class LoraConfig(Section):
    """LoRA adapters on the actor (torch backend, through peft); off while `rank` is 0.

    Only the adapter weights train; engines, exports and the model a checkpoint holds get
    merged weights (W + alpha / rank * B @ A) under the base model's names."""

    rank: int = Field(
        0, ge=0,
        description="Adapter rank r; 0 turns LoRA off (full fine-tuning). 8-64 is usual.",
    )
    alpha: int = Field(
        16, gt=0, description="Scale numerator: the update B @ A is multiplied by alpha / rank."
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Modules that get adapters: peft's 'all-linear' (every linear layer but the "
        "output head), a list of module-name suffixes (e.g. [q_proj, v_proj]), or a regex.",
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="Dropout on the adapters' input (peft lora_dropout). Only 0 is accepted: the "
        "trainer runs the policy in eval mode so that the on-policy importance ratio is exactly "
        "1, which any dropout would break; a non-zero value is refused, not silently ignored.",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @model_validator(mode="after")
    def _check_lora(self) -> LoraConfig:
        if self.dropout != 0.0:
            raise ValueError(
                "train.lora.dropout must be 0: rollflow trains with dropout off (eval mode) so "
                "that the on-policy importance ratio is exactly 1"
            )
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("train.lora.target_modules is empty: name at least one module")
        return self


def check_parallel_sizes(world: int | None, tp: int, pp: int, ep: int) -> None:
    """The megatron TP x PP x DP grid fits `world` train ranks (None: not known here), and
    expert parallelism fits inside it: megatron places an expert's EP ranks among the DP
    ranks (its expert grid is tp x ep x expert-dp x pp, with the experts' TP equal to TP), so
    EP divides the DP size. EP beside TP > 1 needs sequence parallelism in megatron, which
    rollflow does not set up."""
    if ep > 1 and tp > 1:
        raise ValueError(
            f"train.expert_parallel={ep} needs train.tensor_parallel=1 (not {tp}): megatron "
            "runs expert parallelism beside tensor parallelism only with sequence parallelism"
        )
    if world is None:
        return
    sizes = f"train.tensor_parallel={tp} x train.pipeline_parallel={pp}"
    if world % (tp * pp):
        raise ValueError(f"{sizes} does not divide the {world} train ranks")
    if (world // (tp * pp)) % ep:
        raise ValueError(
            f"train.expert_parallel={ep} does not divide the data-parallel size "
            f"{world // (tp * pp)} ({world} train ranks / ({sizes}))"
        )


class TrainConfig(Section):
    backend: Literal["torch", "megatron", "mock"] = Field(
        "torch", description="torch (HF model, CPU/GPU), megatron (megatron-core, GPU only), mock."
    )
    tensor_parallel: int = Field(1, ge=1, description="megatron: tensor-parallel size.")
    pipeline_parallel: int = Field(1, ge=1, description="megatron: pipeline-parallel size.")
    expert_parallel: int = Field(
        1, ge=1, description="megatron, MoE models: expert-parallel size, the ranks one "
        "layer's experts are split over (whole experts each). Must divide the model's "
        "num_experts and the data-parallel size (train ranks / (tensor x pipeline)); needs "
        "tensor_parallel 1."
    )
    strategy: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="torch: how the train ranks share the model. ddp: every rank holds the "
        "whole model, gradients and optimizer state, and gradients are all-reduced. fsdp2: "
        "torch's fully_shard; parameters, gradients and AdamW state are split across the "
        "ranks, each decoder layer gathered for its forward and backward (1/N of the "
        "memory, for models one GPU cannot hold with their optimizer). Checkpoints are then "
        "a sharded torch.distributed.checkpoint beside the HF export, and resume on any rank "
        "count. One rank trains alike either way.",
    )
    fsdp_cpu_offload: bool = Field(
        False,
        description="fsdp2: keep the sharded parameters, gradients and optimizer state in "
        "CPU memory (torch's CPUOffloadPolicy); each layer is copied to the GPU for its "
        "forward and backward, and the optimizer steps on the CPU.",
    )
    context_parallel: int = Field(
        1, ge=1,
        description="torch: split each sequence of a micro-batch across this many train "
        "ranks (context parallelism: each holds 1/N of its tokens and activations, and "
        "attention gathers the keys and values of the whole sequence), for sequences one "
        "GPU's memory cannot train. The train ranks must be a multiple of it; the samples "
        "are split over ranks / N data-parallel shares. Dense models, padded rows (no "
        "pack_sequences or share_prompts), no critic or LoRA.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="torch: recompute each decoder layer's activations in the backward "
        "instead of keeping them (actor and critic): a long sequence then needs one layer's "
        "activations, for about one more forward of compute.",
    )
    flash_attention: bool | None = Field(
        None,
        description="torch: attention with no materialized mask where the rows allow it, so "
        "SDPA can take its flash kernels (a 4-D mask sends it to slower kernels that compute "
        "every query/key pair). Padded rows run plain causal attention: right padding never "
        "reaches a real token, so the padding mask is dropped. With pack_sequences (no "
        "shared prompts) a micro-batch is one row of its real tokens through varlen flash "
        "attention (torch.nn.attention.varlen; bf16 on a GPU, elsewhere SDPA per sequence). "
        "The same log-probs and gradients up to float rounding (other kernels). MoE models "
        "keep the padding mask (their router loss reads it). Default (null): on a GPU.",
    )
    compile_layers: bool = Field(
        False,
        description="torch: torch.compile each decoder layer's forward (dynamic shapes, one "
        "compile for all layers of a model), fusing its norms, rotary embedding and "
        "activation; the first steps pay the compile. The same numbers up to float rounding "
        "(fused kernels).",
    )
    chunked_lm_head: bool = Field(
        False,
        description="torch: run the LM head and the log-prob/entropy head a chunk of tokens "
        "at a time, projecting each chunk again in the backward: a long sequence's "
        "[tokens, vocab] logits are never held whole (about 0.29 GiB per 1k tokens in bf16 "
        "for a 151,936-token vocab, as much again for their gradient), for about one more "
        "LM-head forward of compute (engines/train/chunked_head.py).",
    )
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
        None, ge=1, description="Optimizer steps (warmup included) until min_lr (cosine/linear); "
        "default: the whole run (rollouts x passes x optimizer steps per rollout batch).",
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
    share_prompts: bool | None = Field(
        None,
        description="torch backend: compute a prompt once for all of its responses in a "
        "micro-batch (one row per prompt under a custom attention mask; same log-probs and "
        "gradients up to float rounding, ~2x less work for 8 short responses per prompt). "
        "Used when the model's attention is sdpa; false: one padded row per sample. "
        "Default (null): on the CPU only. On a GPU the masked attention cannot take the "
        "flash kernels that causal padded rows use, and it measured slower "
        "(bench/RESULTS.md, \"Megatron GRPO\").",
    )
    pack_sequences: bool = Field(
        False,
        description="Sequence packing: micro-batches hold samples end to end instead of padded "
        "to their longest, and max_tokens_per_micro_batch counts real tokens. torch backend "
        "(actor, ref, teacher; the critic stays padded): samples or shared-prompt rows packed "
        "into rows under a block-diagonal mask (needs sdpa attention), row width chosen to "
        "balance tail padding against masked attention; megatron: one row per micro-batch "
        "through flash varlen attention (bf16; float32 runs SDPA per sequence). Same "
        "log-probs and gradients as padded batches up to float rounding. It pays where "
        "padding is large and loses where it is small (bench/RESULTS.md, \"Megatron "
        "GRPO\"), so turn it on for long-tailed response lengths.",
    )
    skip_zero_gradient_samples: bool = Field(
        True,
        description="Leave out of the actor's forward/backward (and of the old-log-prob "
        "forward) the samples whose loss and gradient are exactly 0: no loss-masked token, "
        "or, under the plain PPO-clip loss (no entropy bonus, no KL loss), an advantage of 0 "
        "on every token, e.g. a GRPO group whose responses all got the same reward. Each step's "
        "loss still divides by all of its samples, so the update is the same up to float "
        "rounding; approx_kl, entropy and the mismatch metrics then average over the "
        "trained samples (train/zero_gradient_samples counts the skipped ones). Not with "
        "algorithm.kl_coef, use_opd or a custom advantage function (they score every sample).",
    )
    save_interval: int | None = Field(
        None, ge=1, description="Checkpoint every N steps (None: only the last step)."
    )
    checkpoint_staging_dir: str | None = Field(
        None,
        description="Local directory where the train ranks write a checkpoint before it goes to "
        "storage.uri (and where an object-store checkpoint is downloaded to load it); made if "
        "missing, the same path on every node. Default: the system temp dir (TMPDIR), which "
        "may be too small for a large model. On the file system of a local storage.uri, a "
        "checkpoint is renamed into the run instead of copied.",
    )
    seed: int = 1234
    deterministic: bool = Field(
        False,
        description="Bit-for-bit runs: a run resumed after any crash (kill -9 of the driver "
        "included) ends with the weights an uninterrupted run ends with, bit for bit. The "
        "torch trainer pins its thread count at every call (the count it was built with, "
        "in whichever thread the call runs), and the embedded engine "
        "runs batch-invariant (engine.batch_invariant), so each rollout log-prob depends on "
        "its own request only. On one machine and software stack; the speed it costs is in "
        "bench/RESULTS.md (\"Deterministic mode\"). See docs/fault-tolerance.md.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype; bfloat16 autocasts over float32 master weights."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda (this process's local rank) when available, else cpu."
    )
    weight_sync: Literal["tensor", "distributed", "disk"] = Field(
        "tensor",
        description="How new weights reach the engines: tensor (trainer -> Ray object store -> "
        "engine actors; colocated on a GPU, SGLang's /update_weights_from_tensor with CUDA IPC "
        "handles, no bytes copied), distributed (pause, process-group broadcast in buckets, flush, continue), "
        "disk (save_pretrained + /update_weights_from_disk).",
    )
    weight_update_pause: Literal["abort", "retract", "in_place"] = Field(
        "abort",
        description="How a weight update pauses the engines (SGLang's /pause_generation "
        "modes): abort ends in-flight requests with their partial output, which the rollout "
        "continues on the new weights; retract (drop the KV cache, re-prefill) and in_place "
        "(keep it) let in-flight requests go on with the new weights without leaving the "
        "engine. Nothing generated is thrown away in any mode; each token records the weight "
        "version that produced it (the token_versions column, from SGLang's meta_info.weight_versions).",
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
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA adapters instead of full fine-tuning (torch backend; off by default).",
    )

    def optimizer_steps_per_rollout(self, rollout_samples: int) -> int:
        """Optimizer steps one rollout batch of `rollout_samples` makes, all passes counted."""
        if self.num_steps_per_rollout is not None:
            per_pass = self.num_steps_per_rollout
        elif self.global_batch_size is not None:
            per_pass = max(1, -(-rollout_samples // self.global_batch_size))
        else:
            per_pass = 1
        return per_pass * self.num_epochs_per_rollout

    @model_validator(mode="after")
    def _check_train(self) -> TrainConfig:
        if self.global_batch_size is not None and self.num_steps_per_rollout is not None:
            raise ValueError("set train.global_batch_size or train.num_steps_per_rollout, not both")
        if self.expert_parallel > 1 and self.backend != "megatron":
            raise ValueError(
                f"train.expert_parallel={self.expert_parallel}: expert parallelism is "
                f"implemented by train.backend=megatron only (not {self.backend})"
            )
        check_parallel_sizes(None, self.tensor_parallel, self.pipeline_parallel,
                             self.expert_parallel)
        if self.lora.enabled and self.backend == "megatron":
            raise ValueError(
                "train.lora: LoRA is implemented by train.backend=torch only; set "
                "train.lora.rank=0 for megatron"
            )
        if self.strategy == "fsdp2" and self.backend != "torch":
            raise ValueError(
                f"train.strategy=fsdp2 is the torch trainer's; train.backend={self.backend} "
                "shards with its own settings (megatron: tensor_parallel, pipeline_parallel)"
            )
        if self.chunked_lm_head and self.backend != "torch":
            raise ValueError(
                f"train.chunked_lm_head is the torch trainer's; train.backend={self.backend} "
                "has its own head (megatron: vocab-parallel, through token_stats)"
            )
        if self.compile_layers and self.backend != "torch":
            raise ValueError(f"train.compile_layers is the torch trainer's, not "
                             f"train.backend={self.backend}'s")
        if self.fsdp_cpu_offload and self.strategy != "fsdp2":
            raise ValueError("train.fsdp_cpu_offload needs train.strategy=fsdp2")
        if self.strategy == "fsdp2" and self.lora.enabled:
            raise ValueError(
                "train.strategy=fsdp2 with train.lora: not supported; LoRA trains a few "
                "adapter weights, which ddp holds on every rank at little cost"
            )
        if self.context_parallel > 1:
            self._check_context_parallel()
        if self.lora.enabled and self.backend == "torch" and self.model_path is None:
            raise ValueError(
                "train.lora needs train.model_path: the base model the adapters are trained on "
                "(train.load then names a checkpoint of the LoRA run)"
            )
        return self

    def _check_context_parallel(self) -> None:
        """What `context_parallel` > 1 cannot be combined with, named in one line."""
        clash = [name for name, on in (
            (f"train.backend={self.backend}", self.backend != "torch"),
            ("train.pack_sequences", self.pack_sequences),
            ("train.share_prompts", bool(self.share_prompts)),
            ("train.lora", self.lora.enabled),
        ) if on]
        if clash:
            raise ValueError(
                f"train.context_parallel={self.context_parallel} is the torch trainer's, on "
                f"padded rows of a dense model: not supported with {', '.join(clash)}"
            )

