"""The embedded train backend: Hugging Face models trained with plain PyTorch.

`train(samples, rollout_id)` is the shared step (`step.py`: partitions, advantages, losses,
metrics); this module is its `StepModel`: HF models for the actor, the frozen reference and
teacher and the critic (`critic.py`), scored in token-budgeted micro-batches, and per
optimizer step a forward/backward per micro-batch, clip, AdamW and the LR schedule
(`optim_step.py`), with DDP or FSDP2 across ranks (`distributed.py`: each rank's loss times
the world size turns the gradient average back into the step's sum; `fsdp.py`), and with
`train.context_parallel` each sequence split across a group of ranks (`context_parallel.py`).

Dropout stays off (slime's RL recipes set it to 0): on-policy the importance ratio must be
exactly 1. Checkpoints: see `checkpoint_io.py`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import AutoConfig, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engines.config.algorithm import AlgorithmConfig
from engines.config.train import TrainConfig
from engines.train import checkpoint_io as ckpt
from engines.train import fsdp, lora
from engines.train.batching import PaddedBatch, build_padded_batch, effective_temperature
from engines.train.context_parallel import ContextGroup, use_context_parallel
from engines.train.critic import CRITIC_DIR, ValueModel, response_values
from engines.train.device import resolve_device
from engines.train.distributed import DataParallel, data_shares
from engines.train.finite import check_finite, raise_nonfinite
from engines.train.flash_attention import runs_flash_attention, use_flash_attention
from engines.train.lr_schedule import make_scheduler, retarget
from engines.train.optim_step import OptimizedModel, optimizer_step
from engines.train.packing import build_packed_batch, model_hidden_size
from engines.train.prompt_sharing import build_shared_prompt_batch, supports_prompt_sharing
from engines.train.rollout_prep import Scorers
from engines.train.routing_replay import build_replay_batch, replay_layout
from engines.train.step import TrainStep
from engines.train.step_model import PREFIX, Forward, MicroBatch, MicroBatchLoss, Part, Role
from engines.train.step_settings import FIXED_AT_BUILD, StepSettings
from engines.train.torch_models import (
    BuildBatch,
    autocast,
    checkpoint_activations,
    compile_layers,
    load_causal_lm,
    move_state,
    response_log_probs,
    response_outputs,
    score_samples,
    scoring_batches,
)
from engines.weights import hf_export
from engines.weights.model_families import check_model_config, moe_layout
from storage.sample import Sample

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TorchTrainBackend:
    """Actor, optional frozen reference / teacher, optional critic, on one device per rank."""

    fixed_at_build: frozenset[str] = FIXED_AT_BUILD  # train keys `use_settings` cannot change

    def __init__(
        self,
        train_cfg: TrainConfig,
        algo_cfg: AlgorithmConfig,
        rollout_temperature: float = 1.0,
        num_threads: int | None = None,
        reward_key: str | None = None,
    ) -> None:
        source = train_cfg.load or train_cfg.model_path
        if source is None:
            raise ValueError("train.model_path (or train.load) is required by the torch trainer")
        if num_threads:
            torch.set_num_threads(num_threads)
        # (a CPU reduction's order follows the thread count: train.deterministic pins it)
        self._threads = torch.get_num_threads()
        self.train_cfg, self.algo_cfg = train_cfg, algo_cfg
        self.temperature = effective_temperature(rollout_temperature)
        self.reward_key = reward_key
        self.device = resolve_device(train_cfg.device)
        self.dp = DataParallel.current(train_cfg.strategy, train_cfg.context_parallel)
        self.context = ContextGroup.build(train_cfg.context_parallel)
        self._amp = getattr(torch, train_cfg.dtype)
        self._initial = train_cfg.model_path or source
        if train_cfg.load:
            ckpt.verify_checkpoint(train_cfg.load)
        check_model_config(AutoConfig.from_pretrained(self._initial), "torch", self._initial)
        torch.manual_seed(train_cfg.seed)
        self._shuffle = torch.Generator().manual_seed(train_cfg.seed)
        self.step = TrainStep(train_cfg, algo_cfg, self, self._shuffle, reward_key)
        # LoRA: the reference is the policy with its adapters off (lora.py), not a copy
        lora_on = train_cfg.lora.enabled
        self.ref_model = self._frozen(self._initial) if self._needs_ref() and not lora_on else None
        self.teacher_model = self._frozen(algo_cfg.opd_teacher_path) if algo_cfg.use_opd else None
        self._build_trainables(source)
        # MoE: plain padded rows, whose 2-D mask HF's load-balancing loss reads and whose
        # tokens line up with the engine's recorded routing (routing_replay.py)
        self._moe = moe_layout(self.model.config)
        if self.context is not None and (self._moe is not None or algo_cfg.uses_critic):
            raise ValueError(
                f"train.context_parallel={train_cfg.context_parallel}: supported for dense "
                "models without a critic (this run has "
                f"{'an MoE model' if self._moe is not None else 'a PPO critic'})"
            )
        if train_cfg.pack_sequences and self._moe is not None:
            raise ValueError("train.pack_sequences is not supported for MoE models (their "
                             "router loss and routing replay need one padded row per sample)")
        if algo_cfg.routing_replay:
            replay_layout(self.model)  # a clear error for a dense model
        if train_cfg.pack_sequences and not supports_prompt_sharing(self.model):
            raise ValueError(
                "train.pack_sequences needs a model on sdpa attention (a custom 4-D mask); "
                f"{source} uses {self.model.config._attn_implementation!r}"
            )
        self.pad_token_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.version = 0
        if train_cfg.load and ckpt.has_checkpoint(train_cfg.load):
            self._restore_state(train_cfg.load)

    def use_settings(self, settings: StepSettings) -> None:
        """Train the next steps under `settings` (a replay switches to the ones a step was
        trained under); the `fixed_at_build` keys and the models stay as built."""
        self.train_cfg, self.algo_cfg = settings.train, settings.algorithm
        self.temperature = effective_temperature(settings.temperature)
        self.reward_key = settings.reward_key
        self.step = TrainStep(settings.train, settings.algorithm, self, self._shuffle,
                              settings.reward_key)
        self._apply_schedules()

    def _apply_schedules(self) -> None:
        """The optimizers' settings from `train_cfg`: a restored optimizer state brings back
        the ones it was saved with (lr, weight decay, betas)."""
        cfg = self.train_cfg
        for part, lr in ((self.actor, cfg.lr), (self.critic, cfg.critic_lr or cfg.lr)):
            if part is not None:
                for group in part.optimizer.param_groups:
                    group["weight_decay"], group["betas"] = cfg.weight_decay, cfg.adam_betas
                retarget(part.scheduler, cfg, lr)
                part.clip_grad = cfg.clip_grad
                part.max_consecutive_skips = cfg.max_consecutive_skipped_steps

    # -- construction ---------------------------------------------------------------------
    def _needs_ref(self) -> bool:
        return self.algo_cfg.uses_reference

    def _frozen(self, path: str | None) -> PreTrainedModel:
        assert path is not None
        model = load_causal_lm(path, self.device).requires_grad_(False).eval()
        if self.context is not None:
            use_context_parallel(model)
        self._speed_up(model)
        if self.dp.sharded:  # every rank scores every sample: the gathers stay in step
            self._shard(model)
        return model

    def _speed_up(self, model: torch.nn.Module) -> None:
        """`train.flash_attention` (dense models outside context parallelism: they keep
        their own attention) and `train.compile_layers`, as a model is built."""
        if self._flash and moe_layout(getattr(model, "config", None)) is None:
            use_flash_attention(model)
        if self.train_cfg.compile_layers:
            compile_layers(model)

    @property
    def _flash(self) -> bool:
        """`train.flash_attention`, by default on a GPU; never under context parallelism."""
        flash = self.train_cfg.flash_attention
        if self.context is not None:
            return False
        return self.device.type == "cuda" if flash is None else flash

    def _shard(self, module: torch.nn.Module) -> torch.nn.Module:
        cfg = self.train_cfg
        param_dtype = self._amp if self._amp != torch.float32 else None
        return self.dp.wrap(module, self.device, param_dtype, cfg.fsdp_cpu_offload)

    def _optimized(self, module: torch.nn.Module, lr: float) -> OptimizedModel:
        cfg = self.train_cfg
        if cfg.activation_checkpointing:  # before sharding: FSDP2's units then hold it
            checkpoint_activations(module)
        # wrapped first: FSDP2 replaces the parameters with their shards, which the
        # optimizer must hold (DDP keeps the module's own)
        wrapped = self._shard(module)
        opt = torch.optim.AdamW(
            lora.trainable_parameters(module), lr=lr, betas=cfg.adam_betas,
            weight_decay=cfg.weight_decay,
        )
        return OptimizedModel(wrapped, opt, make_scheduler(opt, cfg, lr), cfg.clip_grad,
                         cfg.max_consecutive_skipped_steps)

    def _build_trainables(self, source: str) -> None:
        """Actor from `source`; critic (ppo) from `source/critic` when resuming, else from
        `critic_model_path` / the initial policy."""
        cfg = self.train_cfg
        self.model = lora.load_policy(cfg, self._initial, source, self.device)
        if self.context is not None:
            use_context_parallel(self.model)
        self._speed_up(self.model)
        self.actor = self._optimized(self.model, cfg.lr)
        self.critic_model: ValueModel | None = None
        self.critic: OptimizedModel | None = None
        if self.algo_cfg.uses_critic:
            saved = os.path.join(source, CRITIC_DIR)
            path = saved if os.path.isdir(saved) else (cfg.critic_model_path or self._initial)
            self.critic_model = ValueModel.from_pretrained(path, self.device, cfg.seed)
            self.critic = self._optimized(self.critic_model, cfg.critic_lr or cfg.lr)

    # -- scoring --------------------------------------------------------------------------
    def _score(
        self, samples: list[Sample], fn: Callable[[PaddedBatch], Tensor],
        build: BuildBatch = build_padded_batch,
    ) -> list[Tensor]:
        def run(batch: PaddedBatch) -> Tensor:
            with autocast(self.device, self._amp):
                return fn(batch)

        cfg = self.train_cfg
        budget = cfg.max_tokens_per_micro_batch
        packed = cfg.pack_sequences and build is not build_padded_batch  # critic: padded
        by_group = self._share_prompts and build is not build_padded_batch
        dp = self.dp
        if dp.data_size == 1:
            return score_samples(samples, run, budget, self.pad_token_id, self.device, build,
                                 packed, by_group)
        # each data rank scores its share and the ranks swap the results: every rank scoring
        # the whole batch kept these forwards from scaling with the ranks (2 GPUs trained a
        # step 1.12x faster than one; bench/RESULTS.md, "Torch trainer under FSDP2")
        shares = data_shares(len(samples), dp.data_size,
                             [s.group_index for s in samples] if by_group else None)
        forwards = 0
        if dp.sharded:  # FSDP2: a forward is a collective, so every rank runs as many
            forwards = max(len(scoring_batches([samples[i] for i in share], budget, packed,
                                               by_group)) for share in shares)
        mine = shares[dp.data_rank]
        part = [samples[i] for i in mine] or (samples[:1] if forwards else [])
        scores = score_samples(part, run, budget, self.pad_token_id, self.device, build,
                               packed, by_group, forwards)
        return dp.gather_scores(mine, scores[: len(mine)], len(samples))

    def _log_prob_batch(self, model: torch.nn.Module, replay: bool = False) -> BuildBatch:
        """How log-prob forwards of `model` see a micro-batch: with `replay` padded rows
        carrying the engine's routed experts (routing_replay.py); packed rows (packing.py)
        with `pack_sequences`, else one row per prompt where the attention allows it
        (prompt_sharing.py), else (and for MoE models) one padded row per sample."""
        cfg = self.train_cfg
        if replay:
            return functools.partial(build_replay_batch, layout=replay_layout(model))
        if moe_layout(getattr(model, "config", None)) is not None or self.context is not None:
            return build_padded_batch
        if cfg.pack_sequences:
            if self._flash and not self._share_prompts and runs_flash_attention(model):
                # one row, flash varlen attention (a model built with flash attention off,
                # whose settings a replay turned it on for, keeps the masked rows)
                return functools.partial(build_packed_batch, share_prompts=False, varlen=True)
            return functools.partial(build_packed_batch, share_prompts=self._share_prompts,
                                     hidden_size=model_hidden_size(model))
        share = self._share_prompts and supports_prompt_sharing(model)
        return build_shared_prompt_batch if share else build_padded_batch

    def _log_prob_scorer(
        self, model: torch.nn.Module, replay: bool = False
    ) -> Callable[[list[Sample]], list[Tensor]]:
        def scorer(samples: list[Sample]) -> list[Tensor]:
            model.eval()
            return self._score(
                samples,
                lambda b: response_log_probs(model, b, self.temperature, context=self.context,
                                             chunked_head=self.train_cfg.chunked_lm_head,
                                             flash=self._flash)[0],
                self._log_prob_batch(model, replay))

        return scorer

    def _scorers(self) -> Scorers:
        critic = self.critic_model
        return Scorers(
            policy=self._log_prob_scorer(self.model, self.algo_cfg.routing_replay),
            ref=self._ref_scorer(),
            teacher=(
                self._log_prob_scorer(self.teacher_model)
                if self.teacher_model is not None
                else None
            ),
            critic=(
                (lambda ss: self._score(ss, lambda b: response_values(critic, b)))
                if critic is not None
                else None
            ),
        )

    def _ref_scorer(self) -> Callable[[list[Sample]], list[Tensor]] | None:
        if self.ref_model is not None:
            return self._log_prob_scorer(self.ref_model)
        if self._needs_ref():  # LoRA: the base, adapters disabled
            return lora.without_adapters(self.model, self._log_prob_scorer(self.model))
        return None

    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """Current policy's log-probs of each sample's response tokens (rollout temperature)."""
        scorer = self._log_prob_scorer(self.model, self.algo_cfg.routing_replay)
        return [t.tolist() for t in scorer(samples)]

    def score(self, role: Role, samples: list[Sample]) -> list[Tensor]:
        """Response log-probs (policy, ref, teacher) or values (critic) of each sample."""
        scorer = getattr(self._scorers(), role)
        if scorer is None:
            raise ValueError(f"this torch trainer has no {role} model")
        return list(scorer(samples))

    # -- training (the algorithm is step.py's) ----------------------------------------------
    @property
    def dp_rank(self) -> int:
        return self.dp.data_rank

    @property
    def dp_size(self) -> int:
        return self.dp.data_size

    @property
    def lazy_old_log_probs(self) -> bool:
        return not self.dp.enabled

    @property
    def _share_prompts(self) -> bool:
        """`train.share_prompts`, by default on the CPU only (see its description)."""
        share = self.train_cfg.share_prompts
        if self.context is not None:  # context parallelism splits padded rows
            return False
        return self.device.type == "cpu" if share is None else share

    @property
    def shares_prompts(self) -> bool:
        return self._share_prompts and self._moe is None and supports_prompt_sharing(self.model)

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Learn from one rollout batch (`TrainStep.train`); a no-op if already learned.
        Deterministic: on the thread count the backend was built with, in this thread too
        (torch's count is per process, MKL's per calling thread), and with torch's
        deterministic kernels. Without them the backward of the response logits' gather
        (`index_put_` with accumulate) adds with atomic float adds from each thread's share
        of the batch; a group's responses all read its prompt's last position, so where a
        group spans two shares, the order of those adds follows the threads' timing, and
        under load two runs differed in a step's weights (bench/RESULTS.md, "Busy
        machine"). On a GPU they warn where they cannot hold."""
        if self.train_cfg.deterministic:
            torch.set_num_threads(self._threads)
            torch.use_deterministic_algorithms(True, warn_only=self.device.type != "cpu")
        self.model.eval()
        if self.critic_model is not None:
            self.critic_model.eval()
        return self.step.train(samples, rollout_id)

    def optimizer_step(
        self, part: Part, samples: list[Sample], micro_batches: list[MicroBatch],
        loss_fn: MicroBatchLoss,
    ) -> dict[str, float]:
        opt = self.critic if part == "critic" else self.actor
        assert opt is not None, f"no {part} to train"
        if self.dp.sharded:  # each forward and backward is a collective: as many on every rank
            count = fsdp.max_over_ranks(len(micro_batches), self._collective_device)
            micro_batches = fsdp.pad_micro_batches(micro_batches, count)
        return optimizer_step(
            opt, micro_batches, lambda rows: loss_fn(rows, self._forward(part, samples, rows)),
            self.dp, self.device, PREFIX[part],
        )

    def _forward(self, part: Part, samples: list[Sample], rows: list[int]) -> Forward:
        """The trained (DDP-wrapped) module's outputs for `rows`, with gradients."""
        module = self.actor.module if part == "actor" else None
        replay = self.algo_cfg.routing_replay
        build = self._log_prob_batch(module, replay) if module is not None else build_padded_batch
        batch = build([samples[i] for i in rows], self.pad_token_id).to(self.device,
                                                                         non_blocking=True)
        coef = float(getattr(self.model.config, "router_aux_loss_coef", 0.0) or 0.0)
        aux_coef = coef if self._moe is not None else 0.0
        with autocast(self.device, self._amp):
            if part == "critic":
                assert self.critic is not None
                return Forward(batch, values=response_values(self.critic.module, batch))
            log_probs, entropy, aux = response_outputs(
                self.actor.module, batch, self.temperature, self.algo_cfg.entropy_coef != 0.0,
                router_aux_loss=aux_coef > 0.0, context=self.context,
                chunked_head=self.train_cfg.chunked_lm_head, flash=self._flash,
            )
        return Forward(batch, log_probs=log_probs, entropy=entropy,
                       aux_loss=None if aux is None else aux * aux_coef)

    def check_weights_finite(self) -> None:
        self._check_finite("weights after training")

    def _check_finite(self, what: str) -> None:
        """Every trained tensor finite, or `NonFiniteError` (sharded: on every rank alike)."""
        if not self.dp.sharded:
            check_finite(self._named_weights(), what)
            return
        raise_nonfinite(fsdp.nonfinite_names(self._named_weights(), self._collective_device),
                        what)

    @property
    def _collective_device(self) -> torch.device:
        """Where the group's collectives take tensors: the GPU under NCCL, else the CPU."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _named_weights(self) -> list[tuple[str, Tensor]]:
        """Every trained tensor (actor, then critic), as a checkpoint would hold them."""
        named: list[tuple[str, Tensor]] = list(self.model.named_parameters())
        if self.critic_model is not None:
            named += [(f"critic.{n}", p) for n, p in self.critic_model.named_parameters()]
        return named

    # -- colocation -----------------------------------------------------------------------
    def offload(self) -> None:
        """Move every model and optimizer state to the CPU and free the GPU cache, so a
        colocated engine can use the memory between train steps."""
        self._move(torch.device("cpu"))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def onload(self) -> None:
        self._move(self.device)

    def _move(self, device: torch.device) -> None:
        """Sharded, each FSDP module moves its own shards (and with `fsdp_cpu_offload` they
        live on the CPU already: nothing moves)."""
        if self.dp.sharded and self.train_cfg.fsdp_cpu_offload:
            return
        move = fsdp.move_sharded_state if self.dp.sharded else move_state
        move(self.model, self.actor.optimizer, device)
        for frozen in (self.ref_model, self.teacher_model):
            if frozen is not None:
                move(frozen, None, device)
        if self.critic is not None and self.critic_model is not None:
            move(self.critic_model, self.critic.optimizer, device)

    # -- weights and checkpoints ----------------------------------------------------------
    def export_weights(self) -> dict[str, Tensor]:
        """The policy's weights as engines load them, on its device, named like the HF
        model's own state_dict (merged when training LoRA adapters). Sharded, a collective:
        every rank gathers each tensor whole."""
        if self.dp.sharded:
            return fsdp.full_state_dict(self.model, self._collective_device)
        return hf_export.engine_state_dict(self.model)

    def save_hf(self, path: str) -> None:
        """`export_weights` as an HF model directory (disk weight sync); sharded, rank 0
        writes it from the gathered weights."""
        if not self.dp.sharded:
            hf_export.save_hf(self.model, path)
            return
        state = self.export_weights()
        if self.dp.rank == 0:
            self.model.save_pretrained(path, state_dict=state)

    def state_dict_for_engine(self) -> dict[str, Tensor]:
        """A detached CPU copy of `export_weights`; never NaN/inf."""
        state = {k: v.detach().to("cpu", copy=True) for k, v in self.export_weights().items()}
        check_finite(state.items(), "weights for the engines")
        return state

    def save_checkpoint(self, local_dir: str) -> None:
        if self.dp.sharded:
            self._save_sharded_checkpoint(local_dir)
            return
        if self.dp.rank != 0:
            return  # every rank holds the same weights and states
        check_finite(self._named_weights(), f"checkpoint {local_dir}")
        os.makedirs(local_dir, exist_ok=True)
        lora.save_policy(self.model, local_dir)  # HF model (merged) + LoRA adapter/
        tokenizer = self._load_tokenizer()
        if tokenizer is not None:
            tokenizer.save_pretrained(local_dir)
        ckpt.save_state(local_dir, ckpt.OPTIMIZER_FILE, self.actor.optimizer.state_dict())
        ckpt.save_state(local_dir, ckpt.SCHEDULER_FILE, self.actor.scheduler.state_dict())
        if self.critic is not None and self.critic_model is not None:
            self.critic_model.save(local_dir)
            ckpt.save_state(
                local_dir, ckpt.CRITIC_OPTIMIZER_FILE, self.critic.optimizer.state_dict()
            )
            ckpt.save_state(
                local_dir, ckpt.CRITIC_SCHEDULER_FILE, self.critic.scheduler.state_dict()
            )
        ckpt.save_state(local_dir, ckpt.RNG_FILE, ckpt.rng_state(self._shuffle))
        ckpt.write_meta(local_dir, self.version)
        ckpt.write_manifest(local_dir)

    def _save_sharded_checkpoint(self, local_dir: str) -> None:
        """FSDP2: the HF model (gathered; rank 0 writes it) and every rank's shard of the
        optimizer state (DCP); rank 0 the rest, and the manifest once all are written."""
        self._check_finite(f"checkpoint {local_dir}")
        os.makedirs(local_dir, exist_ok=True)
        self.save_hf(local_dir)
        fsdp.save_optimizer(self.model, self.actor.optimizer,
                            os.path.join(local_dir, fsdp.OPTIMIZER_DCP_DIR))
        critic_state = None
        if self.critic is not None and self.critic_model is not None:
            critic_state = fsdp.full_state_dict(self.critic_model, self._collective_device)
            fsdp.save_optimizer(self.critic_model, self.critic.optimizer,
                                os.path.join(local_dir, fsdp.CRITIC_OPTIMIZER_DCP_DIR))
        if self.dp.rank == 0:
            tokenizer = self._load_tokenizer()
            if tokenizer is not None:
                tokenizer.save_pretrained(local_dir)
            ckpt.save_state(local_dir, ckpt.SCHEDULER_FILE, self.actor.scheduler.state_dict())
            if self.critic is not None and self.critic_model is not None:
                self.critic_model.save(local_dir, critic_state)
                ckpt.save_state(
                    local_dir, ckpt.CRITIC_SCHEDULER_FILE, self.critic.scheduler.state_dict()
                )
            ckpt.save_state(local_dir, ckpt.RNG_FILE, ckpt.rng_state(self._shuffle))
            ckpt.write_meta(local_dir, self.version)
        torch.distributed.barrier()
        if self.dp.rank == 0:  # last, once every rank's shards are written
            ckpt.write_manifest(local_dir)

    def load_checkpoint(self, local_dir: str) -> None:
        """Restore weights, optimizers, schedulers, RNG and version from `save_checkpoint`,
        after checking its files against its manifest."""
        ckpt.verify_checkpoint(local_dir)
        self._build_trainables(local_dir)
        self._restore_state(local_dir)

    def _restore_state(self, local_dir: str) -> None:
        """The optimizer, schedules, shuffle and version of the checkpoint at `local_dir`
        (its weights were loaded with the models)."""
        self._check_strategy(local_dir)
        self._load_optimizer(self.model, self.actor.optimizer, local_dir,
                             fsdp.OPTIMIZER_DCP_DIR, ckpt.OPTIMIZER_FILE)
        self.actor.scheduler.load_state_dict(ckpt.load_state(local_dir, ckpt.SCHEDULER_FILE))
        if self.critic is not None:
            assert self.critic_model is not None
            self._load_optimizer(self.critic_model, self.critic.optimizer, local_dir,
                                 fsdp.CRITIC_OPTIMIZER_DCP_DIR, ckpt.CRITIC_OPTIMIZER_FILE)
            sched = ckpt.load_state(local_dir, ckpt.CRITIC_SCHEDULER_FILE)
            self.critic.scheduler.load_state_dict(sched)
        ckpt.restore_rng(ckpt.load_state(local_dir, ckpt.RNG_FILE), self._shuffle)
        self.version = ckpt.read_version(local_dir)
        self._apply_schedules()  # the restored schedulers carry the lr they were saved with

    def _load_optimizer(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, local_dir: str,
        sharded_dir: str, file: str,
    ) -> None:
        """One part's optimizer state: its DCP shards (sharded) or its one file."""
        if self.dp.sharded:
            fsdp.load_optimizer(module, optimizer, os.path.join(local_dir, sharded_dir))
        else:
            optimizer.load_state_dict(ckpt.load_state(local_dir, file))

    def _check_strategy(self, local_dir: str) -> None:
        """A checkpoint's optimizer state is kept the way its strategy keeps it (one file, or
        DCP shards): resuming it under the other strategy is refused in one line."""
        sharded = os.path.isdir(os.path.join(local_dir, fsdp.OPTIMIZER_DCP_DIR))
        if sharded == self.dp.sharded:
            return
        held = ("as FSDP2 shards (train.strategy=fsdp2 on a train group)" if sharded else
                "in one file (an unsharded trainer: train.strategy=ddp, or one rank)")
        raise ValueError(
            f"checkpoint {local_dir} holds its optimizer state {held}, and this trainer "
            f"{'does not shard' if sharded else 'shards'}: resume it the way it was saved, "
            f"or start a new run from its HF weights with train.model_path={local_dir}"
        )

    def _load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        src = self._initial
        if not any(os.path.exists(os.path.join(src, name)) for name in _TOKENIZER_FILES):
            return None
        return AutoTokenizer.from_pretrained(src)

