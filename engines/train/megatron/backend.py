"""`MegatronTrainBackend`: the torch backend's API and losses on a megatron-core GPTModel.

Every rank of a torchrun job (or a single process) builds one backend and calls the same
methods with the same samples. One `train(samples, rollout_id)`:

    rewards -> GRPO advantages -> old log-probs (one forward-only pass; or the engine's)
    -> ref log-probs (use_kl_loss) -> per epoch, per global batch:
         this DP rank's share (idx[dp_rank::dp]) cut into micro-batches by padded tokens,
         megatron's forward_backward schedule (PP-aware) with `actor_loss` on the last stage,
         the distributed optimizer's step (grad clipping inside)

Losses are divided by the *global* step denominator, and the model config sets
`calculate_per_token_loss`, so megatron sums gradients over micro-batches and DP ranks
instead of averaging them: the gradient is the unsplit batch's, as in the torch backend.
Non-finite losses, gradients and weights are handled as `engines/train/finite.py` says; every
such decision is reduced over all ranks first, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engines.algorithms.advantages import grpo_advantages_by_group
from engines.algorithms.config import AlgorithmConfig
from engines.algorithms.losses import LossInputs, actor_loss
from engines.train.batching import (
    build_padded_batch,
    effective_temperature,
    gather_response_logits,
    pad_response_values,
    split_micro_batches,
)
from engines.train.checkpoint_io import verify_checkpoint, write_manifest
from engines.train.config import TrainConfig
from engines.train.finite import (
    NonFiniteError,
    check_finite,
    nonfinite_names,
    stale_on_failure,
)
from engines.train.megatron import parallel
from engines.train.megatron.hf_convert import (
    ModelShape,
    check_tp,
    hf_to_mcore,
    mcore_to_hf,
    select_stage,
    shard_tp,
    stage_layers,
)
from engines.train.megatron.model import transformer_config
from engines.train.metrics import SKIPPED, TrainMetrics, already_trained
from storage.sample import Sample

META_FILE = "meta.json"
DIST_DIR = "dist_ckpt"
RNG_FILE = "rng.pt"
# megatron 0.19's default optimizer layout (fully_sharded_model_space) emits flattened-range
# ShardedTensors that its own validator then rejects; dp_reshardable saves cleanly.
_OPTIM_META = {"distrib_optim_sharding_type": "dp_reshardable"}


@dataclass(slots=True)
class PreparedBatch:
    """Per-sample inputs of one `train()` call, all from the policy before its first update."""

    rewards: Tensor
    advantages: Tensor
    old_log_probs: list[Tensor] | None
    ref_log_probs: list[Tensor] | None


class MegatronTrainBackend:
    """Actor (and frozen reference) as megatron-core GPTModels with TP/PP/DP."""

    def __init__(
        self,
        train_cfg: TrainConfig,
        algo_cfg: AlgorithmConfig,
        rollout_temperature: float = 1.0,
        reward_key: str | None = None,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
    ) -> None:
        from transformers import AutoConfig

        source = train_cfg.load or train_cfg.model_path
        if train_cfg.model_path is None:
            raise ValueError("train.model_path is required by the megatron trainer")
        self.train_cfg, self.algo_cfg, self.reward_key = train_cfg, algo_cfg, reward_key
        self.temperature = effective_temperature(rollout_temperature)
        self.hf_config = AutoConfig.from_pretrained(train_cfg.model_path)
        self.shape = ModelShape.from_hf_config(self.hf_config)
        check_tp(self.shape, tensor_parallel)
        self.tp, self.pp = tensor_parallel, pipeline_parallel
        self._dtype = getattr(torch, train_cfg.dtype)
        parallel.init_parallel(tensor_parallel, pipeline_parallel, train_cfg.seed)
        torch.manual_seed(train_cfg.seed)
        self._shuffle = torch.Generator().manual_seed(train_cfg.seed)
        self.pad_token_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        # One config for actor and reference: the schedule reads `finalize_model_grads_func`
        # (DP grad reduce, tied-embedding all-reduce across PP stages) from the actor's.
        self.config = transformer_config(self.shape, self.tp, self.pp, self._dtype)
        self.model = self._build(train_cfg.model_path, trainable=True)
        self.ref_model = self._build(train_cfg.model_path, trainable=False) if algo_cfg.use_kl_loss else None
        self.optimizer = self._make_optimizer()
        self.version = 0
        if train_cfg.load and os.path.exists(os.path.join(train_cfg.load, META_FILE)):
            self.load_checkpoint(train_cfg.load)
        elif source != train_cfg.model_path:
            raise ValueError(f"train.load={source!r} has no {META_FILE}: not a megatron checkpoint")

    # -- construction ---------------------------------------------------------------------
    def _build(self, hf_path: str, trainable: bool) -> Any:
        """This rank's stage/shard with HF weights; the actor is wrapped in megatron DDP."""
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from transformers import AutoModelForCausalLM

        from engines.train.megatron.model import build_gpt_model

        model = build_gpt_model(self.shape, self.config).cuda()
        hf = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32).state_dict()
        pre, post = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        layers = stage_layers(self.shape.num_layers, ps.get_pipeline_model_parallel_rank(), self.pp)
        stage = select_stage(hf_to_mcore(hf, self.shape), layers, pre, post)
        if post and not pre and self.shape.tie_word_embeddings:
            stage["output_layer.weight"] = hf["model.embed_tokens.weight"]
        parallel.copy_into(model, shard_tp(stage, ps.get_tensor_model_parallel_rank(), self.tp))
        if not trainable:
            return model.requires_grad_(False).eval()
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        return DistributedDataParallel(self.config, ddp_cfg, model).eval()

    def _make_optimizer(self) -> Any:
        """megatron's distributed optimizer (torch Adam underneath when apex is absent)."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.train_cfg
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_betas[0], adam_beta2=cfg.adam_betas[1], clip_grad=cfg.clip_grad,
            bf16=self._dtype == torch.bfloat16, params_dtype=self._dtype,
            use_distributed_optimizer=True,
        )
        # Our losses carry the global denominator: no extra 1/num_tokens scaling.
        self.config.finalize_model_grads_func = lambda models, _tokens=None, **kw: (
            finalize_model_grads(models, None)
        )
        return get_megatron_optimizer(opt_cfg, [self.model])

    # -- forward ---------------------------------------------------------------------------
    def _run(
        self, model: Any, samples: list[Sample], loss_fn: Any, forward_only: bool
    ) -> list[Any]:
        """Megatron's schedule over `samples` in micro-batches; `loss_fn(batch, rows, logits)`
        runs on the last PP stage and returns `(loss, outputs)`. Returns the outputs."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        lengths = [len(s.tokens) for s in samples]
        mbs = split_micro_batches(lengths, self.train_cfg.max_tokens_per_micro_batch)
        batches = [(rows, build_padded_batch([samples[i] for i in rows], self.pad_token_id))
                   for rows in mbs]

        def forward_step(data_iterator: Any, m: Any) -> tuple[Tensor, Any]:
            rows, batch = next(data_iterator)
            ids = batch.input_ids.cuda()
            pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            out = m(input_ids=ids, position_ids=pos, attention_mask=None)

            def loss_func(logits: Tensor) -> tuple[Tensor, Tensor, Any]:
                loss, result = loss_fn(batch, rows, logits)
                return loss, torch.ones((), dtype=torch.int, device=logits.device), result

            return out, loss_func

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=max(lengths),
            micro_batch_size=max(len(r) for r in mbs), forward_only=forward_only,
        )

    def _log_probs_entropy(self, batch: Any, logits: Tensor, entropy_grad: bool) -> tuple[Tensor, Tensor]:
        resp = gather_response_logits(logits, batch.logit_index.cuda()).float()
        if self.temperature != 1.0:
            resp = resp / self.temperature
        log_probs = parallel.vocab_parallel_log_probs(resp, batch.targets.cuda())
        entropy = parallel.vocab_parallel_entropy(resp if entropy_grad else resp.detach())
        return log_probs, entropy

    @torch.no_grad()
    def _score(self, model: Any, samples: list[Sample]) -> list[Tensor]:
        """Per-sample response log-probs on every rank (DP ranks split the work)."""
        from megatron.core import parallel_state as ps

        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        mine = list(range(rank, len(samples), dp))

        def loss_fn(batch: Any, rows: list[int], logits: Tensor) -> tuple[Tensor, Any]:
            lp, _ = self._log_probs_entropy(batch, logits, False)
            per = [lp[r, : samples[mine[i]].response_length].cpu() for r, i in enumerate(rows)]
            return lp.sum() * 0.0, list(zip(rows, per, strict=True))

        outs = self._run(model, [samples[i] for i in mine], loss_fn, True) if mine else []
        local = {mine[i]: t for out in outs for i, t in out}
        local = parallel.broadcast_from_last_stage(local)
        merged: dict[int, Tensor] = {}
        for part in parallel.all_gather_dp(local):
            merged.update(part)
        return [merged[i] for i in range(len(samples))]

    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """Current policy's log-probs of each sample's response tokens (rollout temperature)."""
        return [t.tolist() for t in self._score(self.model, samples)]

    # -- training --------------------------------------------------------------------------
    def _prepare(self, samples: list[Sample], first_epoch: list[list[int]]) -> PreparedBatch:
        """Rewards, advantages, old and ref log-probs, all from the pre-update policy.

        Old log-probs are scored per optimizer step of the first epoch, so every micro-batch
        has exactly the composition (hence the kernels and bf16 rounding) of the training
        forward that consumes it: step-0 `ppo_kl` is then exactly 0, as on-policy it must be.
        """
        algo = self.algo_cfg
        is_rl = algo.loss_type == "policy_loss"
        if is_rl or all(s.reward is not None for s in samples):
            rewards = torch.tensor([s.scalar_reward(self.reward_key) for s in samples])
        else:
            rewards = torch.zeros(len(samples))
        advantages = torch.zeros(len(samples))
        old: list[Tensor] | None = None
        if is_rl:
            advantages = grpo_advantages_by_group(
                rewards.tolist(), [s.group_index for s in samples], algo.grpo_std_normalization
            )
            if algo.use_rollout_logprobs:
                old = [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]
            else:
                scored: dict[int, Tensor] = {}
                for idx in first_epoch:
                    scored.update(zip(idx, self._score(self.model, [samples[i] for i in idx]), strict=True))
                old = [scored[i] for i in range(len(samples))]
        ref = self._score(self.ref_model, samples) if self.ref_model is not None else None
        return PreparedBatch(rewards.float(), advantages.float(), old, ref)

    def _denominator(self, samples: list[Sample]) -> float:
        if self.algo_cfg.calculate_per_token_loss:
            return float(sum(sum(s.loss_mask) for s in samples))
        return float(len(samples))

    def _optimizer_step(self, samples: list[Sample], prep: PreparedBatch, idx: list[int]) -> dict[str, float]:
        from megatron.core import parallel_state as ps

        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        if len(idx) < dp:
            raise ValueError(f"global batch of {len(idx)} samples < data parallel size {dp}")
        denominator = self._denominator([samples[i] for i in idx])
        mine = idx[rank::dp]
        entropy_grad = self.algo_cfg.entropy_coef != 0.0

        def loss_fn(batch: Any, rows: list[int], logits: Tensor) -> tuple[Tensor, Any]:
            g = [mine[r] for r in rows]
            log_probs, entropy = self._log_probs_entropy(batch, logits, entropy_grad)
            width = log_probs.shape[1]

            def padded(values: list[Tensor] | None) -> Tensor | None:
                return None if values is None else pad_response_values(values, width).cuda()

            old = padded([prep.old_log_probs[i] for i in g]
                         if prep.old_log_probs is not None else None)
            inputs = LossInputs(
                log_probs=log_probs, loss_mask=batch.loss_mask.cuda(), entropy=entropy,
                old_log_probs=old, advantages=prep.advantages[g].unsqueeze(-1).cuda(),
                ref_log_probs=padded([prep.ref_log_probs[i] for i in g]
                                     if prep.ref_log_probs is not None else None),
            )
            loss, terms = actor_loss(self.algo_cfg, inputs, denominator)
            return loss, {k: float(v) for k, v in terms.items()}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outs = self._run(self.model, [samples[i] for i in mine], loss_fn, False)
        totals: dict[str, float] = defaultdict(float)
        for out in outs:
            for k, v in out.items():
                totals[k] += v
        summed = parallel.all_gather_dp(dict(totals))
        result = {k: sum(p.get(k, 0.0) for p in summed) for k in set().union(*summed)}
        result = parallel.broadcast_from_last_stage(result)
        loss = result.get("loss", 0.0)
        if not math.isfinite(loss):  # the same value on every rank
            raise NonFiniteError(f"actor loss is {loss}; the optimizer step was not taken. "
                                 f"Look for NaN/inf advantages or log-probs")
        # megatron checks for inf/nan only with an fp16 loss scaler: bf16/fp32 would step.
        stepped = self._grads_finite()
        if stepped:
            stepped, grad_norm, _ = self.optimizer.step()
            result["grad_norm"] = float(grad_norm or 0.0)  # absent when skipped
        result["skipped_steps"] = float(not stepped)
        return result

    def _any_rank(self, local_flag: bool) -> bool:
        """True if `local_flag` is set on any rank (one all-reduce, so every rank agrees)."""
        import torch.distributed as dist

        flag = torch.tensor(float(local_flag), device="cuda")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _grads_finite(self) -> bool:
        """No rank's gradient buffer holds NaN/inf. With the distributed optimizer a rank
        keeps its own contribution outside its shard, so a NaN anywhere is seen somewhere."""
        bad = torch.zeros((), device="cuda")
        for p in self.model.module.parameters():
            grad = getattr(p, "main_grad", None)
            if grad is not None:
                bad = torch.maximum(bad, torch.logical_not(torch.isfinite(grad)).any().float())
        return not self._any_rank(bool(bad.item()))

    def _check_weights_finite(self) -> None:
        local = nonfinite_names(self.model.module.named_parameters())
        if self._any_rank(bool(local)):
            where = ", ".join(local[:5]) if local else "on another rank"
            raise NonFiniteError(f"weights after training hold NaN/inf ({where})")

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Learn from one rollout batch; a no-op (`{"skipped": 1.0}`) if already learned.
        A failure part-way leaves the backend at `STALE_VERSION` (see `finite.py`)."""
        if already_trained(self.version, samples, rollout_id):
            return dict(SKIPPED)
        with stale_on_failure(self, rollout_id):
            return self._train(samples, rollout_id)

    def _train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        start = time.perf_counter()
        n, size = len(samples), self.train_cfg.global_batch_size or len(samples)
        epochs = []
        for _ in range(self.train_cfg.num_epochs_per_rollout):
            order = torch.randperm(n, generator=self._shuffle).tolist()
            epochs.append([order[i : i + size] for i in range(0, n, size)])
        prep = self._prepare(samples, epochs[0])
        steps = [self._optimizer_step(samples, prep, idx) for epoch in epochs for idx in epoch]
        self._check_weights_finite()
        torch.cuda.synchronize()
        elapsed = max(time.perf_counter() - start, 1e-9)
        self.version = rollout_id + 1
        tokens = sum(len(s.tokens) for s in samples) * self.train_cfg.num_epochs_per_rollout
        return _summarise(samples, prep, steps, tokens / elapsed, self.version)

    # -- weights and checkpoints ----------------------------------------------------------
    def state_dict_for_engine(self) -> dict[str, Tensor]:
        """Full HF-named weights on CPU (TP shards and PP stages gathered), every rank."""
        full = parallel.gather_full_state(self.model.module, self.shape.num_layers)
        state = {k: v.contiguous() for k, v in mcore_to_hf(full, self.shape).items()}
        check_finite(state.items(), "weights for the engines")  # same full state on every rank
        return state

    def _sharded_state(self, loading: bool) -> dict[str, Any]:
        model_sd = self.model.module.sharded_state_dict()
        return {"model": model_sd,
                "optimizer": self.optimizer.sharded_state_dict(
                    model_sd, is_loading=loading, metadata=_OPTIM_META)}

    def save_checkpoint(self, local_dir: str) -> None:
        """`dist_checkpointing` (model + distributed optimizer) plus an HF export on rank 0;
        refused (on every rank, before any write) if a weight is not finite."""
        import torch.distributed as dist
        from megatron.core import dist_checkpointing
        from transformers import AutoModelForCausalLM

        hf_sd = self.state_dict_for_engine()
        step = adam_step(self.optimizer)
        ckpt = os.path.join(local_dir, DIST_DIR)
        if dist.get_rank() == 0:
            os.makedirs(ckpt, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(self._sharded_state(loading=False), ckpt)
        if dist.get_rank() == 0:
            hf = AutoModelForCausalLM.from_config(self.hf_config)
            hf.load_state_dict(hf_sd, strict=False)
            hf.save_pretrained(local_dir)
            torch.save({"torch": torch.get_rng_state(), "shuffle": self._shuffle.get_state()},
                       os.path.join(local_dir, RNG_FILE))
            meta = {"version": self.version, "backend": "megatron", "adam_step": step}
            with open(os.path.join(local_dir, META_FILE), "w") as f:
                json.dump(meta, f)
        dist.barrier()
        if dist.get_rank() == 0:  # last, once every rank's shards are written
            write_manifest(local_dir)

    def load_checkpoint(self, local_dir: str) -> None:
        """Restore model, optimizer, RNG and version written by `save_checkpoint`."""
        from megatron.core import dist_checkpointing

        verify_checkpoint(local_dir)
        with open(os.path.join(local_dir, META_FILE)) as f:
            meta = json.load(f)
        # Without apex/TE the optimizer's state_dict() needs Adam state to exist: a fresh one
        # takes megatron's zero-gradient dummy step; the load overwrites it (and the weights).
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if not opt.optimizer.state:
                opt._init_optimizer_states_with_dummy_values()
        state = dist_checkpointing.load(self._sharded_state(loading=True), os.path.join(local_dir, DIST_DIR))
        self.model.module.load_state_dict(state["model"])
        with torch.no_grad():  # fp32 runs: the optimizer's params are the model's leaves
            self.optimizer.load_state_dict(state["optimizer"])
        if meta.get("adam_step") is not None:
            set_adam_step(self.optimizer, float(meta["adam_step"]))
        rng = torch.load(os.path.join(local_dir, RNG_FILE), weights_only=True)
        torch.set_rng_state(rng["torch"])
        self._shuffle.set_state(rng["shuffle"])
        self.version = int(meta["version"])


def _inner_states(optimizer: Any) -> list[dict[str, Any]]:
    """The per-parameter state dicts of the torch optimizers under megatron's wrappers."""
    return [state for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            for state in opt.optimizer.state.values()]


def adam_step(optimizer: Any) -> float | None:
    """torch Adam's step count (the same for every parameter), None before the first step
    or where the step lives in param groups (apex / TE FusedAdam)."""
    steps = {float(s["step"]) for s in _inner_states(optimizer) if isinstance(s.get("step"), Tensor)}
    if len(steps) > 1:
        raise RuntimeError(f"Adam step counts differ across parameters: {sorted(steps)}")
    return steps.pop() if steps else None


def set_adam_step(optimizer: Any, step: float) -> None:
    """Give every parameter its own Adam `step` tensor holding `step`.

    Without apex/TE, megatron's dist-checkpoint load gets this wrong twice: the `dp_reshardable`
    param state treats `step` as local (so the load copies back the dummy-init step, 1), and
    `DistributedOptimizer.load_state_dict` puts *one* tensor in every parameter's state, which
    torch Adam's in-place `step += 1` then advances once per parameter per update. Either way
    the bias correction after a resume is wrong.
    """
    for state in _inner_states(optimizer):
        if isinstance(state.get("step"), Tensor):
            state["step"] = torch.full_like(state["step"], step)


def _summarise(
    samples: list[Sample], prep: PreparedBatch, steps: list[dict[str, float]],
    tokens_per_s: float, version: int,
) -> dict[str, float]:
    """The same `TrainMetrics` keys as the torch backend (loss terms: mean over steps)."""

    def mean(key: str) -> float:  # over the steps that report `key` (grad_norm: those taken)
        values = [s[key] for s in steps if key in s]
        return sum(values) / len(values) if values else 0.0

    return TrainMetrics(
        loss=mean("loss"), pg_loss=mean("pg_loss"), kl_loss=mean("kl_loss"),
        entropy=mean("entropy"), clipfrac=mean("clipfrac"), approx_kl=mean("approx_kl"),
        grad_norm=mean("grad_norm"), reward_mean=float(prep.rewards.mean()),
        reward_std=float(prep.rewards.std(correction=0)),
        response_len_mean=sum(s.response_length for s in samples) / len(samples),
        adv_mean=float(prep.advantages.mean()), num_samples=float(len(samples)),
        num_optimizer_steps=float(len(steps)), train_tokens_per_s=tokens_per_s,
        weight_version=float(version),
        skipped_steps=float(sum(s.get("skipped_steps", 0.0) for s in steps)),
    ).to_dict()
