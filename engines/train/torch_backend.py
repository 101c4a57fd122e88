"""The embedded train backend: a Hugging Face causal LM trained with plain PyTorch.

One `train(samples, rollout_id)` call is one slime training step:

    samples --rewards--> GRPO advantages (per group_index)
            --policy (no grad)--> old log-probs     (or the engine's, use_rollout_logprobs;
                                                     the first step's come from its own forward)
            --reference (no grad)--> ref log-probs  (only with use_kl_loss)
    for epoch in num_epochs_per_rollout:
        shuffle (seeded) -> optimizer steps of global_batch_size samples
            each step: micro-batches within max_tokens_per_micro_batch padded tokens,
                       loss scaled by the step's sample (or token) count -> backward,
                       clip grad norm, AdamW step
    version = rollout_id + 1

Because every micro-batch loss is divided by the *step's* denominator, accumulating
micro-batches gives the gradient of the unsplit batch; the token budget only trades memory
for speed. The weight version makes `train` idempotent: replaying a committed batch on a
policy that already learned from it is a no-op.

Checkpoints are HF `save_pretrained` directories plus `optimizer.pt`, `rng.pt` (global torch
RNG and the shuffle generator) and `meta.json` (version), so a resumed run continues
bit-for-bit where the uninterrupted one would be.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from engines.algorithms.advantages import grpo_advantages_by_group
from engines.algorithms.losses import LossInputs, actor_loss, entropy_from_logits
from engines.train.batching import (
    PaddedBatch,
    build_padded_batch,
    effective_temperature,
    gather_response_logits,
    log_probs_from_logits,
    pad_response_values,
    split_micro_batches,
)
from engines.train.metrics import SKIPPED, TrainMetrics
from flows.config import AlgorithmConfig, TrainConfig
from storage.sample import Sample

META_FILE = "meta.json"
OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(slots=True)
class PreparedBatch:
    """Per-sample inputs of one `train()` call, all from the policy before its first update.

    Mutable on purpose: `old_log_probs` entries start as None for the first optimizer step's
    samples and are filled in by that step's forward (see `TorchTrainBackend._prepare`).
    """

    rewards: Tensor
    advantages: Tensor
    old_log_probs: list[Tensor | None] | None
    ref_log_probs: list[Tensor] | None
    response_lengths: list[int]


class TorchTrainBackend:
    """Actor (and frozen reference) on CPU or the current default device, float32 by default."""

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
        self.train_cfg = train_cfg
        self.algo_cfg = algo_cfg
        self.temperature = effective_temperature(rollout_temperature)
        self.reward_key = reward_key
        self._dtype = getattr(torch, train_cfg.dtype)
        self._tokenizer_source = train_cfg.model_path or source
        torch.manual_seed(train_cfg.seed)
        self._shuffle = torch.Generator().manual_seed(train_cfg.seed)
        self.model = self._load_model(source)
        self.ref_model: PreTrainedModel | None = None
        if algo_cfg.use_kl_loss:
            # The reference is the *initial* policy, even when resuming from a checkpoint.
            ref_source = train_cfg.model_path or source
            self.ref_model = (
                copy.deepcopy(self.model) if ref_source == source else self._load_model(ref_source)
            )
            self.ref_model.requires_grad_(False).eval()
        self.optimizer = self._make_optimizer()
        self.pad_token_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.version = 0
        if train_cfg.load and os.path.exists(os.path.join(train_cfg.load, META_FILE)):
            self._restore_state(train_cfg.load)

    # -- construction ---------------------------------------------------------------------
    def _load_model(self, path: str) -> PreTrainedModel:
        return AutoModelForCausalLM.from_pretrained(path, dtype=self._dtype)

    def _make_optimizer(self) -> torch.optim.Optimizer:
        cfg = self.train_cfg
        return torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay
        )

    # -- forward ---------------------------------------------------------------------------
    def _forward(
        self, model: PreTrainedModel, batch: PaddedBatch, entropy_grad: bool = False
    ) -> tuple[Tensor, Tensor]:
        """Response-space `(log_probs, entropy)`, both `[B, R]`, at the rollout temperature.

        Entropy only carries a gradient when it is part of the loss (`entropy_coef != 0`);
        otherwise it is a metric and is computed off the graph.
        """
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        logits = gather_response_logits(out.logits, batch.logit_index)
        if self.temperature != 1.0:
            logits = logits / self.temperature
        log_probs = log_probs_from_logits(logits, batch.targets)
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
        return log_probs, entropy

    @torch.no_grad()
    def _score(self, model: PreTrainedModel, samples: list[Sample]) -> list[Tensor]:
        """Per-sample response log-probs (1-D tensors), micro-batched, no gradients."""
        model.eval()
        result: list[Tensor] = [torch.empty(0)] * len(samples)
        lengths = [len(s.tokens) for s in samples]
        for mb in split_micro_batches(lengths, self.train_cfg.max_tokens_per_micro_batch):
            batch = build_padded_batch([samples[i] for i in mb], self.pad_token_id)
            log_probs, _ = self._forward(model, batch)
            for row, i in enumerate(mb):
                result[i] = log_probs[row, : samples[i].response_length].clone()
        return result

    def compute_log_probs(self, samples: list[Sample]) -> list[list[float]]:
        """Current policy's log-probs of each sample's response tokens (rollout temperature)."""
        return [t.tolist() for t in self._score(self.model, samples)]

    # -- training --------------------------------------------------------------------------
    def _prepare(self, samples: list[Sample], first_step: list[int]) -> PreparedBatch:
        """Rewards, advantages, old and ref log-probs, all from the pre-update policy.

        Old log-probs of the first optimizer step's samples are left as None: that step's
        own forward runs before any update, so it yields them for free (`_old_rows`).
        """
        algo = self.algo_cfg
        n = len(samples)
        is_rl = algo.loss_type == "policy_loss"
        if is_rl or all(s.reward is not None for s in samples):
            rewards = torch.tensor([s.scalar_reward(self.reward_key) for s in samples])
        else:
            rewards = torch.zeros(n)
        advantages = torch.zeros(n)
        old: list[Tensor | None] | None = None
        if is_rl:
            advantages = grpo_advantages_by_group(
                rewards.tolist(), [s.group_index for s in samples], algo.grpo_std_normalization
            )
            if algo.use_rollout_logprobs:
                old = list(self._rollout_log_probs(samples))
            else:
                old = [None] * n
                rest = sorted(set(range(n)) - set(first_step))
                for i, lp in zip(
                    rest, self._score(self.model, [samples[i] for i in rest]), strict=True
                ):
                    old[i] = lp
        ref = self._score(self.ref_model, samples) if self.ref_model is not None else None
        lengths = [s.response_length for s in samples]
        return PreparedBatch(rewards.float(), advantages.float(), old, ref, lengths)

    @staticmethod
    def _rollout_log_probs(samples: list[Sample]) -> list[Tensor]:
        for s in samples:
            if len(s.rollout_log_probs) != s.response_length:
                raise ValueError(
                    f"sample {s.index}: use_rollout_logprobs needs {s.response_length} "
                    f"rollout_log_probs, has {len(s.rollout_log_probs)}"
                )
        return [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in samples]

    def _step_partitions(self, n: int) -> list[list[int]]:
        """One epoch's optimizer steps: a seeded shuffle cut into global-batch chunks."""
        order = torch.randperm(n, generator=self._shuffle).tolist()
        size = self.train_cfg.global_batch_size or n
        return [order[i : i + size] for i in range(0, n, size)]

    def _denominator(self, samples: list[Sample]) -> float:
        if self.algo_cfg.calculate_per_token_loss:
            return float(sum(sum(s.loss_mask) for s in samples))
        return float(len(samples))

    @staticmethod
    def _old_rows(prep: PreparedBatch, rows: list[int], log_probs: Tensor) -> list[Tensor]:
        """Old log-probs of `rows`, filling (once) those that the current forward provides."""
        assert prep.old_log_probs is not None
        for r, i in enumerate(rows):
            if prep.old_log_probs[i] is None:
                width = prep.response_lengths[i]
                prep.old_log_probs[i] = log_probs[r, :width].detach().clone()
        return [t for t in (prep.old_log_probs[i] for i in rows) if t is not None]

    def _micro_batch_loss(
        self, samples: list[Sample], prep: PreparedBatch, rows: list[int], denominator: float
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward + loss of the micro-batch `rows` (indices into `samples` and `prep`)."""
        batch = build_padded_batch([samples[i] for i in rows], self.pad_token_id)
        width = batch.targets.shape[1]
        log_probs, entropy = self._forward(
            self.model, batch, entropy_grad=self.algo_cfg.entropy_coef != 0.0
        )
        old = None
        if prep.old_log_probs is not None:
            old = pad_response_values(self._old_rows(prep, rows, log_probs), width)
        ref = None
        if prep.ref_log_probs is not None:
            ref = pad_response_values([prep.ref_log_probs[i] for i in rows], width)
        inputs = LossInputs(
            log_probs=log_probs,
            loss_mask=batch.loss_mask,
            entropy=entropy,
            old_log_probs=old,
            advantages=prep.advantages[rows].unsqueeze(-1),
            ref_log_probs=ref,
        )
        return actor_loss(self.algo_cfg, inputs, denominator)

    def _optimizer_step(
        self, samples: list[Sample], prep: PreparedBatch, idx: list[int]
    ) -> dict[str, float]:
        """Accumulate the micro-batches of one global batch, clip, and step."""
        self.optimizer.zero_grad(set_to_none=True)
        denominator = self._denominator([samples[i] for i in idx])
        totals: dict[str, float] = defaultdict(float)
        lengths = [len(samples[i].tokens) for i in idx]
        for mb in split_micro_batches(lengths, self.train_cfg.max_tokens_per_micro_batch):
            loss, terms = self._micro_batch_loss(samples, prep, [idx[j] for j in mb], denominator)
            loss.backward()
            for key, value in terms.items():
                totals[key] += float(value)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.train_cfg.clip_grad
        )
        self.optimizer.step()
        totals["grad_norm"] = float(grad_norm)
        return dict(totals)

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Learn from one rollout batch; a no-op (`{"skipped": 1.0}`) if already learned."""
        if self.version > rollout_id:
            return dict(SKIPPED)
        if not samples:
            raise ValueError(f"rollout {rollout_id}: train() got no samples")
        start = time.perf_counter()
        epochs = [
            self._step_partitions(len(samples))
            for _ in range(self.train_cfg.num_epochs_per_rollout)
        ]
        prep = self._prepare(samples, first_step=epochs[0][0])
        # Dropout stays off while training too (slime's RL recipes set it to 0): on-policy
        # the importance ratio must be exactly 1, and old log-probs can reuse a forward.
        self.model.eval()
        steps = [self._optimizer_step(samples, prep, idx) for epoch in epochs for idx in epoch]
        elapsed = max(time.perf_counter() - start, 1e-9)
        self.version = rollout_id + 1
        tokens = sum(len(s.tokens) for s in samples) * len(epochs)
        return _summarise(samples, prep, steps, tokens / elapsed, self.version).to_dict()

    # -- weights and checkpoints ----------------------------------------------------------
    def state_dict_for_engine(self) -> dict[str, Tensor]:
        """A detached CPU copy named like the HF model's own state_dict."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, local_dir: str) -> None:
        os.makedirs(local_dir, exist_ok=True)
        self.model.save_pretrained(local_dir)
        tokenizer = self._load_tokenizer()
        if tokenizer is not None:
            tokenizer.save_pretrained(local_dir)
        torch.save(self.optimizer.state_dict(), os.path.join(local_dir, OPTIMIZER_FILE))
        rng = {"torch": torch.get_rng_state(), "shuffle": self._shuffle.get_state()}
        torch.save(rng, os.path.join(local_dir, RNG_FILE))
        with open(os.path.join(local_dir, META_FILE), "w") as f:
            json.dump({"version": self.version, "backend": "torch"}, f)

    def load_checkpoint(self, local_dir: str) -> None:
        """Restore weights, optimizer, RNG and version written by `save_checkpoint`."""
        self.model = self._load_model(local_dir)
        self.optimizer = self._make_optimizer()
        self._restore_state(local_dir)

    def _restore_state(self, local_dir: str) -> None:
        opt_state = torch.load(os.path.join(local_dir, OPTIMIZER_FILE), weights_only=True)
        self.optimizer.load_state_dict(opt_state)
        rng = torch.load(os.path.join(local_dir, RNG_FILE), weights_only=True)
        torch.set_rng_state(rng["torch"])
        self._shuffle.set_state(rng["shuffle"])
        with open(os.path.join(local_dir, META_FILE)) as f:
            self.version = int(json.load(f)["version"])

    def _load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        src = self._tokenizer_source
        if not any(os.path.exists(os.path.join(src, name)) for name in _TOKENIZER_FILES):
            return None
        return AutoTokenizer.from_pretrained(src)


def _summarise(
    samples: list[Sample],
    prep: PreparedBatch,
    steps: list[dict[str, float]],
    tokens_per_s: float,
    version: int,
) -> TrainMetrics:
    def step_mean(key: str) -> float:
        return sum(s.get(key, 0.0) for s in steps) / len(steps)

    return TrainMetrics(
        loss=step_mean("loss"),
        pg_loss=step_mean("pg_loss"),
        kl_loss=step_mean("kl_loss"),
        entropy=step_mean("entropy"),
        clipfrac=step_mean("clipfrac"),
        approx_kl=step_mean("approx_kl"),
        grad_norm=step_mean("grad_norm"),
        reward_mean=float(prep.rewards.mean()),
        reward_std=float(prep.rewards.std(correction=0)),
        response_len_mean=sum(s.response_length for s in samples) / len(samples),
        adv_mean=float(prep.advantages.mean()),
        num_samples=float(len(samples)),
        num_optimizer_steps=float(len(steps)),
        train_tokens_per_s=tokens_per_s,
        weight_version=float(version),
        rollout_logprob_abs_diff=rollout_logprob_abs_diff(samples, prep.old_log_probs),
    )


def rollout_logprob_abs_diff(
    samples: list[Sample], old_log_probs: list[Tensor | None] | None
) -> float:
    """Token-mean |trainer - engine| log-prob over samples that carry engine log-probs."""
    total, count = 0.0, 0
    for s, old in zip(samples, old_log_probs or [], strict=False):
        if old is None or len(s.rollout_log_probs) != s.response_length or not s.response_length:
            continue
        engine = torch.tensor(s.rollout_log_probs, dtype=old.dtype)
        total += float((old.detach() - engine).abs().sum())
        count += s.response_length
    return total / count if count else float("nan")
