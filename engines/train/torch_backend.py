"""The embedded train backend: Hugging Face models trained with plain PyTorch.

One `train(samples, rollout_id)` call is one slime training step:

    samples --(rollout_prep)--> rewards, old / ref / teacher log-probs, critic values,
                                advantages + returns from the estimator registry
    for epoch in num_epochs_per_rollout:
        shuffle (seeded) -> optimizer steps of global_batch_size samples
            (or n / num_steps_per_rollout), each step:
            critic (ppo): clipped value loss -> its own AdamW + LR schedule
            actor (unless rollout_id < num_critic_only_steps): this rank's share, in
                micro-batches within max_tokens_per_micro_batch padded tokens, loss scaled
                by the step's sample (or token) count -> backward, clip, AdamW, LR step
    version = rollout_id + 1

Dividing every micro-batch loss by the *step's* denominator makes accumulation (and DDP
ranks, see `distributed.py`) give the gradient of the unsplit batch. The weight version
makes `train` idempotent. Dropout stays off (slime's RL recipes set it to 0): on-policy the
importance ratio must be exactly 1. Checkpoints: see `checkpoint_io.py`.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from engines.algorithms.config import AlgorithmConfig
from engines.algorithms.losses import LossInputs, actor_loss, critic_loss
from engines.algorithms.registry import load_estimator
from engines.hooks import load_hook
from engines.train import checkpoint_io as ckpt
from engines.train import lora
from engines.train.batching import (
    PaddedBatch,
    build_padded_batch,
    effective_temperature,
    pad_response_values,
    split_micro_batches,
)
from engines.train.config import TrainConfig
from engines.train.critic import CRITIC_DIR, ValueModel, response_values
from engines.train.distributed import DataParallel
from engines.train.finite import check_finite, stale_on_failure
from engines.train.lr_schedule import make_scheduler
from engines.train.metrics import SKIPPED, already_trained, summarise
from engines.train.optim_step import Optimized, optimizer_step
from engines.train.rollout_prep import PreparedBatch, Scorers, prepare_batch
from engines.train.torch_models import (
    autocast,
    load_causal_lm,
    move_state,
    resolve_device,
    response_log_probs,
    score_samples,
)
from storage.sample import Sample

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TorchTrainBackend:
    """Actor, optional frozen reference / teacher, optional critic, on one device per rank."""

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
        self.train_cfg, self.algo_cfg = train_cfg, algo_cfg
        self.temperature = effective_temperature(rollout_temperature)
        self.reward_key = reward_key
        self.device = resolve_device(train_cfg.device)
        self.dp = DataParallel.current()
        self._amp = getattr(torch, train_cfg.dtype)
        self._initial = train_cfg.model_path or source
        if train_cfg.load:
            ckpt.verify_checkpoint(train_cfg.load)
        torch.manual_seed(train_cfg.seed)
        self._shuffle = torch.Generator().manual_seed(train_cfg.seed)
        self.estimator = load_estimator(algo_cfg)
        self.custom_loss: Callable[..., tuple[Tensor, dict[str, Tensor]]] | None = None
        if algo_cfg.loss_type == "custom_loss":
            assert algo_cfg.custom_loss_function_path is not None
            self.custom_loss = load_hook(
                algo_cfg.custom_loss_function_path, "algorithm.custom_loss_function_path", 3
            )
        # LoRA: the reference is the policy with its adapters off (lora.py), not a copy
        lora_on = train_cfg.lora.enabled
        self.ref_model = self._frozen(self._initial) if self._needs_ref() and not lora_on else None
        self.teacher_model = self._frozen(algo_cfg.opd_teacher_path) if algo_cfg.use_opd else None
        self._build_trainables(source)
        self.pad_token_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.version = 0
        if train_cfg.load and ckpt.has_checkpoint(train_cfg.load):
            self._restore_state(train_cfg.load)

    # -- construction ---------------------------------------------------------------------
    def _needs_ref(self) -> bool:
        return self.algo_cfg.use_kl_loss or self.algo_cfg.kl_coef != 0

    def _frozen(self, path: str | None) -> PreTrainedModel:
        assert path is not None
        model = load_causal_lm(path, self.device)
        return model.requires_grad_(False).eval()

    def _optimized(self, module: torch.nn.Module, lr: float) -> Optimized:
        cfg = self.train_cfg
        opt = torch.optim.AdamW(
            lora.trainable_parameters(module), lr=lr, betas=cfg.adam_betas,
            weight_decay=cfg.weight_decay,
        )
        wrapped = self.dp.wrap(module, self.device)
        return Optimized(wrapped, opt, make_scheduler(opt, cfg, lr), cfg.clip_grad,
                         cfg.max_consecutive_skipped_steps)

    def _build_trainables(self, source: str) -> None:
        """Actor from `source`; critic (ppo) from `source/critic` when resuming, else from
        `critic_model_path` / the initial policy."""
        cfg = self.train_cfg
        self.model = lora.load_policy(cfg, self._initial, source, self.device)
        self.actor = self._optimized(self.model, cfg.lr)
        self.critic_model: ValueModel | None = None
        self.critic: Optimized | None = None
        if self.algo_cfg.uses_critic:
            saved = os.path.join(source, CRITIC_DIR)
            path = saved if os.path.isdir(saved) else (cfg.critic_model_path or self._initial)
            self.critic_model = ValueModel.from_pretrained(path, self.device)
            self.critic = self._optimized(self.critic_model, cfg.critic_lr or cfg.lr)

    # -- scoring --------------------------------------------------------------------------
    def _score(self, samples: list[Sample], fn: Callable[[PaddedBatch], Tensor]) -> list[Tensor]:
        def run(batch: PaddedBatch) -> Tensor:
            with autocast(self.device, self._amp):
                return fn(batch)

        cfg = self.train_cfg
        return score_samples(
            samples, run, cfg.max_tokens_per_micro_batch, self.pad_token_id, self.device
        )

    def _log_prob_scorer(self, model: torch.nn.Module) -> Callable[[list[Sample]], list[Tensor]]:
        def scorer(samples: list[Sample]) -> list[Tensor]:
            model.eval()
            return self._score(samples, lambda b: response_log_probs(model, b, self.temperature)[0])

        return scorer

    def _scorers(self) -> Scorers:
        critic = self.critic_model
        return Scorers(
            policy=self._log_prob_scorer(self.model),
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
        return [t.tolist() for t in self._log_prob_scorer(self.model)(samples)]

    # -- training -------------------------------------------------------------------------
    def _step_partitions(self, n: int) -> list[list[int]]:
        """One epoch's optimizer steps: a seeded shuffle cut into global-batch chunks."""
        order = torch.randperm(n, generator=self._shuffle).tolist()
        cfg = self.train_cfg
        if cfg.num_steps_per_rollout is not None:
            size = math.ceil(n / cfg.num_steps_per_rollout)
        else:
            size = cfg.global_batch_size or n
        return [order[i : i + size] for i in range(0, n, size)]

    def _denominator(self, samples: list[Sample], idx: list[int]) -> float:
        if self.algo_cfg.calculate_per_token_loss:
            return float(sum(sum(samples[i].loss_mask) for i in idx))
        return float(len(idx))

    def _micro_batches(self, samples: list[Sample], idx: list[int]) -> list[list[int]]:
        mine = self.dp.shard(idx)
        lengths = [len(samples[i].tokens) for i in mine]
        budget = self.train_cfg.max_tokens_per_micro_batch
        return [[mine[j] for j in mb] for mb in split_micro_batches(lengths, budget)]

    def _rows(self, prep: PreparedBatch, rows: list[int], width: int, key: str) -> Tensor | None:
        values = getattr(prep, key)
        if values is None:
            return None
        return pad_response_values([values[i] for i in rows], width).to(self.device)

    @staticmethod
    def _old_rows(prep: PreparedBatch, rows: list[int], log_probs: Tensor) -> list[Tensor]:
        """Old log-probs of `rows`, filling (once) those that the current forward provides."""
        assert prep.old_log_probs is not None
        for r, i in enumerate(rows):
            if prep.old_log_probs[i] is None:
                width = prep.response_lengths[i]
                prep.old_log_probs[i] = log_probs[r, :width].detach().float().cpu().clone()
        return [t for t in (prep.old_log_probs[i] for i in rows) if t is not None]

    def _actor_loss(
        self, samples: list[Sample], prep: PreparedBatch, rows: list[int], denominator: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        batch = build_padded_batch([samples[i] for i in rows], self.pad_token_id).to(self.device)
        width = batch.targets.shape[1]
        with autocast(self.device, self._amp):
            log_probs, entropy = response_log_probs(
                self.actor.module, batch, self.temperature, self.algo_cfg.entropy_coef != 0.0
            )
        old = None
        if prep.old_log_probs is not None:
            old_rows = self._old_rows(prep, rows, log_probs)
            old = pad_response_values(old_rows, width).to(self.device)
        inputs = LossInputs(
            log_probs=log_probs,
            loss_mask=batch.loss_mask,
            entropy=entropy,
            old_log_probs=old,
            advantages=self._rows(prep, rows, width, "advantages"),
            ref_log_probs=self._rows(prep, rows, width, "ref_log_probs"),
            rollout_log_probs=self._rows(prep, rows, width, "rollout_log_probs"),
        )
        loss_fn = self.custom_loss or actor_loss
        loss, terms = loss_fn(self.algo_cfg, inputs, denominator)
        if prep.opd_reverse_kl is not None:
            kl = self._rows(prep, rows, width, "opd_reverse_kl")
            assert kl is not None
            terms = {**terms, "opd_reverse_kl": _reduce_like(self.algo_cfg, kl, batch, denominator)}
        return loss, terms

    def _critic_loss(
        self, samples: list[Sample], prep: PreparedBatch, rows: list[int], denominator: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        assert self.critic is not None
        batch = build_padded_batch([samples[i] for i in rows], self.pad_token_id).to(self.device)
        width = batch.targets.shape[1]
        with autocast(self.device, self._amp):
            values = response_values(self.critic.module, batch)
        old_values = self._rows(prep, rows, width, "values")
        returns = self._rows(prep, rows, width, "returns")
        assert old_values is not None and returns is not None
        return critic_loss(self.algo_cfg, values, old_values, returns, batch.loss_mask, denominator)

    def _step(
        self, samples: list[Sample], prep: PreparedBatch, idx: list[int], train_actor: bool
    ) -> dict[str, float]:
        denominator = self._denominator(samples, idx)
        mbs = self._micro_batches(samples, idx)
        out: dict[str, float] = {}
        if self.critic is not None:
            out.update(
                optimizer_step(
                    self.critic,
                    mbs,
                    lambda rows: self._critic_loss(samples, prep, rows or idx[:1], denominator),
                    self.dp,
                    self.device,
                    prefix="critic/",
                )
            )
        if train_actor:
            out.update(
                optimizer_step(
                    self.actor,
                    mbs,
                    lambda rows: self._actor_loss(samples, prep, rows or idx[:1], denominator),
                    self.dp,
                    self.device,
                )
            )
        return out

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Learn from one rollout batch; a no-op (`{"skipped": 1.0}`) if already learned.

        Raises before the version moves on if a loss or a weight is not finite; any failure
        part-way leaves the backend at `STALE_VERSION` (see `finite.py`)."""
        if already_trained(self.version, samples, rollout_id):
            return dict(SKIPPED)
        with stale_on_failure(self, rollout_id):
            return self._train(samples, rollout_id)

    def _train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        start = time.perf_counter()
        epochs = [
            self._step_partitions(len(samples))
            for _ in range(self.train_cfg.num_epochs_per_rollout)
        ]
        # Lazy old log-probs need every rank to see its first-step samples again later,
        # which sharding does not guarantee: data parallel scores them all up front.
        first = [] if self.dp.enabled else epochs[0][0]
        prep = prepare_batch(
            samples, self.algo_cfg, self._scorers(), self.estimator, first, self.reward_key
        )
        self.model.eval()
        if self.critic_model is not None:
            self.critic_model.eval()
        train_actor = not (
            self.critic is not None and rollout_id < self.train_cfg.num_critic_only_steps
        )
        steps = [self._step(samples, prep, idx, train_actor) for ep in epochs for idx in ep]
        check_finite(self._named_weights(), "weights after training")
        elapsed = max(time.perf_counter() - start, 1e-9)
        self.version = rollout_id + 1
        tokens = sum(len(s.tokens) for s in samples) * len(epochs)
        return summarise(
            samples,
            prep.rewards,
            prep.advantages,
            prep.old_log_probs,
            steps,
            tokens / elapsed,
            self.version,
        ).to_dict()

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
        move_state(self.model, self.actor.optimizer, device)
        for frozen in (self.ref_model, self.teacher_model):
            if frozen is not None:
                move_state(frozen, None, device)
        if self.critic is not None and self.critic_model is not None:
            move_state(self.critic_model, self.critic.optimizer, device)

    # -- weights and checkpoints ----------------------------------------------------------
    def state_dict_for_engine(self) -> dict[str, Tensor]:
        """A detached CPU copy named like the HF model's own state_dict; never NaN/inf."""
        weights = lora.engine_state_dict(self.model)  # merged when training LoRA adapters
        state = {k: v.detach().to("cpu", copy=True) for k, v in weights.items()}
        check_finite(state.items(), "weights for the engines")
        return state

    def save_checkpoint(self, local_dir: str) -> None:
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

    def load_checkpoint(self, local_dir: str) -> None:
        """Restore weights, optimizers, schedulers, RNG and version from `save_checkpoint`,
        after checking its files against its manifest."""
        ckpt.verify_checkpoint(local_dir)
        self._build_trainables(local_dir)
        self._restore_state(local_dir)

    def _restore_state(self, local_dir: str) -> None:
        self.actor.optimizer.load_state_dict(ckpt.load_state(local_dir, ckpt.OPTIMIZER_FILE))
        self.actor.scheduler.load_state_dict(ckpt.load_state(local_dir, ckpt.SCHEDULER_FILE))
        if self.critic is not None:
            opt = ckpt.load_state(local_dir, ckpt.CRITIC_OPTIMIZER_FILE)
            self.critic.optimizer.load_state_dict(opt)
            sched = ckpt.load_state(local_dir, ckpt.CRITIC_SCHEDULER_FILE)
            self.critic.scheduler.load_state_dict(sched)
        ckpt.restore_rng(ckpt.load_state(local_dir, ckpt.RNG_FILE), self._shuffle)
        self.version = ckpt.read_version(local_dir)

    def _load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        src = self._initial
        if not any(os.path.exists(os.path.join(src, name)) for name in _TOKENIZER_FILES):
            return None
        return AutoTokenizer.from_pretrained(src)


def _reduce_like(
    algo: AlgorithmConfig, x: Tensor, batch: PaddedBatch, denominator: float
) -> Tensor:
    from engines.algorithms.losses import make_reducer

    return make_reducer(algo.calculate_per_token_loss, batch.loss_mask, denominator)(x).detach()
