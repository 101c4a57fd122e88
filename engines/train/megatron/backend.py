"""`MegatronTrainBackend`: the shared train step (`engines/train/step.py`) on megatron-core
GPTModels with TP/PP/DP, i.e. its `StepModel`:

    actor      GPTModel in megatron DDP + distributed optimizer (torch Adam without apex),
               LR schedule set on its param groups before each step (`lr_schedule`)
    critic     (ppo) the same with a `ValueHead` for the vocab projection, own optimizer
    reference  (KL loss / KL shaping) and OPD teacher: frozen GPTModels
    score      forward-only over DP-strided samples (`schedule.score`)
    step       megatron's forward_backward schedule (PP-aware) with the step's loss on the
               last stage, sums over micro-batches and DP ranks, non-finite checks, step

Every rank of a torchrun job or a Ray train group builds one backend and calls the same
methods with the same samples. Losses carry the *global* step denominator and the model
config sets `calculate_per_token_loss`, so megatron sums gradients over micro-batches and DP
ranks instead of averaging them: the gradient is the unsplit batch's, as in the torch
backend. Every non-finite decision is reduced over all ranks first, so no rank is left
waiting in a collective. Weight export (`export_weights`) is a collective over TP/PP ranks.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from engines.config.algorithm import AlgorithmConfig
from engines.config.train import TrainConfig
from engines.train.batching import PaddedBatch, effective_temperature
from engines.train.checkpoint_io import verify_checkpoint, write_manifest
from engines.train.finite import NonFiniteError, check_finite, nonfinite_names
from engines.train.lr_schedule import scheduled_lr
from engines.train.megatron import checkpoint as ckpt
from engines.train.megatron import parallel, schedule
from engines.train.megatron.hf_convert import (
    ModelShape,
    check_ep,
    check_tp,
    hf_to_mcore,
    mcore_to_hf,
    select_stage,
    shard_ep,
    shard_tp,
    stage_layers,
)
from engines.train.megatron.model import transformer_config
from engines.train.megatron.offload import Offloaded, move_frozen, offload_part, onload_part
from engines.train.megatron.response_head import ResponseSlots
from engines.train.optim_step import TRAINED_LOSS, check_loss, count_skip
from engines.train.step import TrainStep
from engines.train.step_model import PREFIX, MicroBatch, MicroBatchLoss, Part, Role
from engines.train.step_settings import FIXED_AT_BUILD, StepSettings
from storage.sample import Sample

META_FILE = ckpt.META_FILE
log = logging.getLogger(__name__)


@dataclass
class OptimizedModel:
    """One trained part: DDP-wrapped model, distributed optimizer, its LR schedule position."""

    model: Any
    optimizer: Any
    base_lr: float
    lr_steps: int = 0
    consecutive_skips: int = 0
    offloaded: Offloaded | None = None


def _finalize_grads(models: list[Any], _tokens: Any = None, **_: Any) -> None:
    """DP grad reduce (and tied-embedding all-reduce across PP stages); our losses carry the
    global denominator, so no extra 1/num_tokens scaling."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    finalize_model_grads(models, None)


class MegatronTrainBackend:
    """Actor (+ critic), frozen reference / teacher, as megatron-core GPTModels."""

    # megatron's optimizer config takes these too, when it is built
    fixed_at_build: frozenset[str] = FIXED_AT_BUILD | {"clip_grad", "weight_decay", "adam_betas"}

    def __init__(
        self,
        train_cfg: TrainConfig,
        algo_cfg: AlgorithmConfig,
        rollout_temperature: float = 1.0,
        reward_key: str | None = None,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        expert_parallel: int = 1,
    ) -> None:
        source = train_cfg.load or train_cfg.model_path
        if train_cfg.model_path is None:
            raise ValueError("train.model_path is required by the megatron trainer")
        self.train_cfg, self.algo_cfg = train_cfg, algo_cfg
        self.temperature = effective_temperature(rollout_temperature)
        self.hf_config, self.shape = _shape(train_cfg.model_path, tensor_parallel)
        check_ep(self.shape, expert_parallel)
        self._replay()  # a clear error now for a dense model
        if self.shape.is_moe and train_cfg.pack_sequences:
            raise ValueError("train.pack_sequences is not supported for MoE models (one padded "
                             "row per sample, as on the torch backend)")
        if self.shape.router_aux_loss_coef > 0:
            log.warning("%s: router_aux_loss_coef=%g is not applied by the megatron backend "
                        "(no load-balancing loss; docs/models.md)", train_cfg.model_path,
                        self.shape.router_aux_loss_coef)
        self.tp, self.pp, self.ep = tensor_parallel, pipeline_parallel, expert_parallel
        self._dtype = getattr(torch, train_cfg.dtype)
        parallel.init_parallel(tensor_parallel, pipeline_parallel, train_cfg.seed, expert_parallel)
        torch.manual_seed(train_cfg.seed)
        self._shuffle = torch.Generator().manual_seed(train_cfg.seed)
        self.step = TrainStep(train_cfg, algo_cfg, self, self._shuffle, reward_key)
        self.pad_token_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        self.config = self._config(self.shape)
        self.actor = self._trainable(train_cfg.model_path, train_cfg.lr, critic=False)
        self.model, self.optimizer = self.actor.model, self.actor.optimizer
        self.ref_model = self._frozen(train_cfg.model_path) if algo_cfg.uses_reference else None
        self.teacher_model = self._frozen(algo_cfg.opd_teacher_path) if algo_cfg.use_opd else None
        self.critic: OptimizedModel | None = None
        if algo_cfg.uses_critic:
            path = train_cfg.critic_model_path or train_cfg.model_path
            self.critic = self._trainable(path, train_cfg.critic_lr or train_cfg.lr, critic=True)
        self.version = 0
        if train_cfg.load and os.path.exists(os.path.join(train_cfg.load, META_FILE)):
            self.load_checkpoint(train_cfg.load)
        elif source != train_cfg.model_path:
            raise ValueError(f"train.load={source!r} has no {META_FILE}: not a megatron checkpoint")

    def use_settings(self, settings: StepSettings) -> None:
        """Train the next steps under `settings` (see TorchTrainBackend.use_settings); the
        LR schedule is read at each optimizer step, from `train_cfg` and each part's base."""
        self.train_cfg, self.algo_cfg = settings.train, settings.algorithm
        self.temperature = effective_temperature(settings.temperature)
        self.step = TrainStep(settings.train, settings.algorithm, self, self._shuffle,
                              settings.reward_key)
        self._set_base_lrs()

    def _set_base_lrs(self) -> None:
        cfg = self.train_cfg
        self.actor.base_lr = cfg.lr
        if self.critic is not None:
            self.critic.base_lr = cfg.critic_lr or cfg.lr

    # -- construction ---------------------------------------------------------------------
    def _config(self, shape: ModelShape) -> Any:
        # The schedule reads `finalize_model_grads_func` from the model it runs.
        config = transformer_config(shape, self.tp, self.pp, self._dtype,
                                    ep=self.ep if shape.is_moe else 1)
        config.finalize_model_grads_func = _finalize_grads
        return config

    def _load_hf(self, model: Any, hf_path: str, shape: ModelShape, critic: bool) -> None:
        """This rank's stage/shard of an HF checkpoint into `model` (a critic keeps its
        value head: the HF LM head is not its output layer)."""
        from megatron.core import parallel_state as ps
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).state_dict()
        pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        full = hf_to_mcore(hf, shape)
        if critic:
            full.pop("output_layer.weight", None)
        layers = stage_layers(shape.num_layers, ps.get_pipeline_model_parallel_rank(), self.pp)
        stage = select_stage(full, layers, pre, post)
        if post and not pre and shape.tie_word_embeddings and not critic:
            stage["output_layer.weight"] = hf["model.embed_tokens.weight"]
        stage = shard_tp(stage, ps.get_tensor_model_parallel_rank(), self.tp)
        if shape.is_moe:
            stage = shard_ep(stage, ps.get_expert_model_parallel_rank(), self.ep,
                             shape.num_experts)
        if critic and post:
            stage.update({f"output_layer.{n}": p.detach()
                          for n, p in model.output_layer.named_parameters()})
        parallel.copy_into(model, stage)

    def _frozen(self, hf_path: str | None) -> Any:
        from engines.train.megatron.model import build_gpt_model

        assert hf_path is not None
        _, shape = _shape(hf_path, self.tp)
        check_ep(shape, self.ep if shape.is_moe else 1)
        config = self.config if shape == self.shape else self._config(shape)
        model = build_gpt_model(shape, config)
        self._load_hf(model, hf_path, shape, critic=False)
        return model.requires_grad_(False).eval()

    def _trainable(self, hf_path: str, lr: float, critic: bool) -> OptimizedModel:
        """Model in megatron DDP + its distributed optimizer (torch Adam without apex)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from engines.train.megatron.model import build_gpt_model

        cfg = self.train_cfg
        model = build_gpt_model(self.shape, self.config, value_head=critic, seed=cfg.seed)
        self._load_hf(model, hf_path, self.shape, critic)
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        ddp = DistributedDataParallel(self.config, ddp_cfg, model).eval()
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_betas[0], adam_beta2=cfg.adam_betas[1], clip_grad=cfg.clip_grad,
            bf16=self._dtype == torch.bfloat16, params_dtype=self._dtype,
            use_distributed_optimizer=True,
        )
        return OptimizedModel(ddp, get_megatron_optimizer(opt_cfg, [ddp]), lr)

    def _parts(self) -> dict[str, OptimizedModel]:
        return {"actor": self.actor, **({"critic": self.critic} if self.critic else {})}

    # -- StepModel --------------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state as ps

        return int(ps.get_data_parallel_rank())

    @property
    def layout(self) -> dict[str, int]:
        """The group's parallel layout, stored with each checkpoint (`ckpt.check_layout`)."""
        return {"tensor_parallel": self.tp, "pipeline_parallel": self.pp,
                "expert_parallel": self.ep, "data_parallel": self.dp_size}

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state as ps

        return int(ps.get_data_parallel_world_size())

    @property
    def lazy_old_log_probs(self) -> bool:
        return self.dp_size == 1 and self.pp == 1

    @property
    def shares_prompts(self) -> bool:
        return False  # one (padded or varlen-packed) sequence per sample

    def score(self, role: Role, samples: list[Sample]) -> list[Tensor]:
        models = {"policy": self.actor.model, "ref": self.ref_model,
                  "teacher": self.teacher_model, "critic": self.critic and self.critic.model}
        model = models[role]
        if model is None:
            raise ValueError(f"this megatron trainer has no {role} model")
        cfg = self.train_cfg
        replay = self._replay() if role == "policy" else None
        return schedule.score(model, samples, cfg.max_tokens_per_micro_batch, self.pad_token_id,
                              role == "critic", self.temperature, cfg.pack_sequences, replay)

    def _replay(self) -> schedule.Replay:
        """(MoE layers, experts per token) while `algorithm.routing_replay` is on: the
        policy's forwards route as the engine did (docs/models.md); reference, teacher and
        critic route on their own. MoE models train on padded rows only (`__init__`)."""
        if not self.algo_cfg.routing_replay:
            return None
        if not self.shape.is_moe:
            raise ValueError(f"algorithm.routing_replay needs an MoE model; "
                             f"{self.train_cfg.model_path} is dense")
        return self.shape.num_layers, self.shape.moe_topk

    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """Current policy's log-probs of each sample's response tokens (rollout temperature)."""
        return [t.tolist() for t in self.score("policy", samples)]

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Learn from one rollout batch (`TrainStep.train`); a no-op if already learned."""
        return self.step.train(samples, rollout_id)

    def optimizer_step(
        self, part: Part, samples: list[Sample], micro_batches: list[MicroBatch],
        loss_fn: MicroBatchLoss,
    ) -> dict[str, float]:
        t, prefix, critic = self._parts()[part], PREFIX[part], part == "critic"
        entropy_grad = self.algo_cfg.entropy_coef != 0.0

        def on_output(
            mb: MicroBatch, batch: PaddedBatch, slots: ResponseSlots, output: Tensor
        ) -> tuple[Tensor, Any]:
            fwd = schedule.to_forward(batch, slots, output, critic, self.temperature,
                                      entropy=not critic, entropy_grad=entropy_grad)
            loss, terms = loss_fn(mb.rows, fwd)
            if not mb.counted:
                return loss * 0.0, {}
            # kept on the device: a float() per micro-batch would stall the GPU each time
            out = {prefix + k: torch.as_tensor(v).detach().float() for k, v in terms.items()}
            out[TRAINED_LOSS] = loss.detach().float()
            return loss, out

        t.model.zero_grad_buffer()
        t.optimizer.zero_grad()
        with record_function("megatron.forward_backward"):
            outs = schedule.run(t.model, samples, schedule.even_micro_batches(micro_batches),
                                self.pad_token_id, on_output, False, self.train_cfg.pack_sequences,
                                None if critic else self._replay())
        ranks = parallel.all_gather_dp(_sum_on_host(outs))
        result = {k: sum(r.get(k, 0.0) for r in ranks) for k in set().union(*ranks)}
        result = parallel.broadcast_from_last_stage(result)
        loss_value = result.pop(TRAINED_LOSS, 0.0)
        # megatron checks for inf/nan only with an fp16 loss scaler: bf16/fp32 would step.
        with record_function("megatron.grads_finite"):
            skip = not (math.isfinite(loss_value) and self._grads_finite(t.model))
        lr, grad_norm = scheduled_lr(self.train_cfg, t.base_lr, t.lr_steps), math.nan
        if not skip:
            for group in t.optimizer.param_groups:
                group["lr"] = lr
            with record_function("megatron.optimizer_step"):
                stepped, norm, _ = t.optimizer.step()
            skip, grad_norm = not stepped, float(norm or 0.0)
        t.consecutive_skips = count_skip(
            t.consecutive_skips, skip, self.train_cfg.max_consecutive_skipped_steps, prefix
        )
        if not skip:
            t.lr_steps += 1
            result[prefix + "grad_norm"] = grad_norm  # absent when skipped
        check_loss(loss_value, grad_norm, prefix)
        result[prefix + "skipped_steps"] = float(skip)
        result[prefix + "lr"] = lr
        return result

    def _any_rank(self, local_flag: bool) -> bool:
        """True if `local_flag` is set on any rank (one all-reduce, so every rank agrees)."""
        import torch.distributed as dist

        flag = torch.tensor(float(local_flag), device=parallel.current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _grads_finite(self, model: Any) -> bool:
        """No rank's gradient buffer holds NaN/inf. With the distributed optimizer a rank
        keeps its own contribution outside its shard, so a NaN anywhere is seen somewhere."""
        flat = [b.grad_data for b in getattr(model, "buffers", []) + getattr(model, "expert_parallel_buffers", [])
                if getattr(b, "grad_data", None) is not None]  # DDP's contiguous grad buffers
        grads = flat or [g for p in model.module.parameters()
                         if (g := getattr(p, "main_grad", None)) is not None]
        bad = torch.zeros((), device=parallel.current_device())
        for grad in grads:
            bad = torch.maximum(bad, torch.logical_not(torch.isfinite(grad)).any().float())
        return not self._any_rank(bool(bad.item()))

    def check_weights_finite(self) -> None:
        local = [f"{name}.{n}" for name, t in self._parts().items()
                 for n in nonfinite_names(t.model.module.named_parameters())]
        if self._any_rank(bool(local)):
            where = ", ".join(local[:5]) if local else "on another rank"
            raise NonFiniteError(f"weights after training hold NaN/inf ({where})")

    # -- colocation -----------------------------------------------------------------------
    def offload(self) -> None:
        """Parameters, gradients and optimizer states of every model to the CPU (see
        `offload.py`), so a colocated engine can use the GPU between train steps."""
        for t in self._parts().values():
            if t.offloaded is None:
                t.offloaded = offload_part(t.model, t.optimizer)
        for frozen in (self.ref_model, self.teacher_model):
            if frozen is not None:
                move_frozen(frozen, "cpu")
        torch.cuda.empty_cache()

    def onload(self) -> None:
        for t in self._parts().values():
            if t.offloaded is not None:
                onload_part(t.model, t.optimizer, t.offloaded)
                t.offloaded = None
        for frozen in (self.ref_model, self.teacher_model):
            if frozen is not None:
                move_frozen(frozen, parallel.current_device())

    # -- weights and checkpoints ----------------------------------------------------------
    def export_weights(self) -> dict[str, Tensor]:
        """Full HF-named policy weights (TP shards and PP stages gathered) on every rank, on
        the CPU. A collective over all ranks: every rank must call it."""
        full = parallel.gather_full_state(self.actor.model.module, self.shape.num_layers)
        return {k: v.contiguous() for k, v in mcore_to_hf(full, self.shape).items()}

    def state_dict_for_engine(self) -> dict[str, Tensor]:
        """`export_weights`, refused if not finite (the same full state on every rank)."""
        state = self.export_weights()
        check_finite(state.items(), "weights for the engines")
        return state

    def save_hf(self, path: str, state: dict[str, Tensor] | None = None) -> None:
        """The policy as an HF model directory, written by rank 0 (export is collective)."""
        import torch.distributed as dist
        from transformers import AutoModelForCausalLM

        state = self.export_weights() if state is None else state
        if dist.get_rank() == 0:
            hf = AutoModelForCausalLM.from_config(self.hf_config)
            hf.load_state_dict(state, strict=False)
            hf.save_pretrained(path)

    def save_checkpoint(self, local_dir: str) -> None:
        """Every part's `dist_checkpointing` shards plus an HF export on rank 0 (see
        `checkpoint.py`); refused (on every rank, before any write) if a weight is not finite."""
        import torch.distributed as dist

        hf_sd = self.state_dict_for_engine()
        meta: dict[str, Any] = {"version": self.version, "parts": {}, "layout": self.layout}
        for name, t in self._parts().items():
            meta["parts"][name] = {"adam_step": ckpt.adam_step(t.optimizer), "lr_step": t.lr_steps}
            ckpt.save_part(t.model, t.optimizer, os.path.join(local_dir, ckpt.PART_DIRS[name]))
        self.save_hf(local_dir, hf_sd)
        if dist.get_rank() == 0:
            ckpt.save_rng(local_dir, self._shuffle)
            ckpt.write_meta(local_dir, meta)
        dist.barrier()
        if dist.get_rank() == 0:  # last, once every rank's shards are written
            write_manifest(local_dir)

    def load_checkpoint(self, local_dir: str) -> None:
        """Restore models, optimizers, LR schedules, RNG and version from `save_checkpoint`."""
        verify_checkpoint(local_dir)
        meta = ckpt.read_meta(local_dir)
        ckpt.check_layout(local_dir, meta.get("layout"), self.layout, int(meta["version"]))
        saved = meta.get("parts") or {"actor": {"adam_step": meta.get("adam_step")}}
        for name, t in self._parts().items():
            path = os.path.join(local_dir, ckpt.PART_DIRS[name])
            if name not in saved or not os.path.isdir(path):
                raise FileNotFoundError(f"checkpoint {local_dir}: no {name} state ({path})")
            step = saved[name].get("adam_step")
            ckpt.load_part(t.model, t.optimizer, path, None if step is None else float(step))
            t.lr_steps = int(saved[name].get("lr_step", 0))
        ckpt.load_rng(local_dir, self._shuffle)
        self.version = int(meta["version"])


def _sum_on_host(outs: list[dict[str, Tensor]]) -> dict[str, float]:
    """Per-micro-batch metric tensors summed per key, brought to the host in one copy."""
    keys = sorted(set().union(*outs)) if outs else []
    if not keys:
        return {}
    device = next(v.device for out in outs for v in out.values())
    zero = torch.zeros((), device=device)
    sums = torch.stack([sum((out.get(k, zero) for out in outs), zero) for k in keys])
    return dict(zip(keys, sums.tolist(), strict=True))


def _shape(hf_path: str, tp: int) -> tuple[Any, ModelShape]:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(hf_path)
    shape = ModelShape.from_hf_config(hf_config)
    check_tp(shape, tp)
    return hf_config, shape
