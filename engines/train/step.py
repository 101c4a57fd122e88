"""One slime training step, the same for every backend (torch, megatron).

    train(samples, rollout_id)        (a no-op if the policy is already past rollout_id)
      partitions: per epoch the groups in a seeded shuffle, cut into optimizer steps of
                  global_batch_size samples (or n / num_steps_per_rollout)
      prepare (rollout_prep): rewards; old / ref / teacher log-probs and critic values from
                  the pre-update models (backend.score); advantages + returns (registry);
                  each step's actor rows less its zero-gradient samples (skip_zero_gradient_samples)
      per epoch, per optimizer step:
          denominator = the step's samples (or loss tokens), skipped ones included; this DP
          rank's share of the trained rows cut into
          micro-batches of at most max_tokens_per_micro_batch padded tokens
          (real tokens with pack_sequences)
          critic (ppo): clipped value loss          -> backend.optimizer_step("critic", ...)
          actor (after num_critic_only_steps): actor_loss or the custom loss, corrections, OPD
                                                    -> backend.optimizer_step("actor", ...)
      weights finite? -> version = rollout_id + 1 -> metrics (step means, missing keys
      skipped; batch statistics over all samples)

The backend (`step_model.StepModel`) runs forward, backward and the optimizer; this module
decides what is computed. Dividing every micro-batch loss by the *step's* denominator makes
accumulation over micro-batches and ranks give the gradient of the unsplit batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

from engines.algorithms.losses import LossInputs, actor_loss, critic_loss, make_reducer
from engines.algorithms.registry import load_estimator
from engines.config.algorithm import AlgorithmConfig
from engines.config.train import TrainConfig
from engines.hooks.loader import checked_returns, load_user_hook
from engines.train.batching import pad_response_values, split_micro_batches, to_device
from engines.train.finite import stale_on_failure
from engines.train.metrics import SKIPPED, already_trained, summarise
from engines.train.rollout_prep import PreparedBatch, Scorers, prepare_batch
from engines.train.step_model import Forward, MicroBatch, MicroBatchLoss, Role, StepModel
from storage.sample import Sample

CustomLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
ZERO_GRADIENT_SAMPLES = "zero_gradient_samples"
# Actor-loss terms to which a zero-gradient sample adds exactly 0 (see
# losses.zero_gradient_samples): with such samples skipped they keep the whole step's value;
# the others (approx_kl, entropy and the mismatch terms) become means over trained samples.
EXACT_WITHOUT_SKIPPED = frozenset({"loss", "pg_loss", "clipfrac", "kl_loss"})
MOE_AUX_LOSS = "moe_aux_loss"  # what an MoE model's load-balancing loss adds to the step's loss


class TrainStep:
    """The algorithm half of a backend's `train()`; `model` is the backend itself."""

    def __init__(
        self,
        train_cfg: TrainConfig,
        algo_cfg: AlgorithmConfig,
        model: StepModel,
        shuffle: torch.Generator,
        reward_key: str | None = None,
    ) -> None:
        self.train_cfg, self.algo_cfg, self.model = train_cfg, algo_cfg, model
        self.shuffle, self.reward_key = shuffle, reward_key
        self.estimator = load_estimator(algo_cfg)
        self.custom_loss: CustomLoss | None = None
        if algo_cfg.loss_type == "custom_loss":
            assert algo_cfg.custom_loss_function_path is not None
            key = "algorithm.custom_loss_function_path"
            self.custom_loss = checked_returns(
                load_user_hook(algo_cfg.custom_loss_function_path, key, 3), key,
                _is_loss_and_terms, "(a scalar loss tensor, {metric name: tensor})",
            )

    def train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        """Learn from one rollout batch; a no-op (`{"skipped": 1.0}`) if already learned.

        Raises before the version moves on if a loss or a weight is not finite; any failure
        part-way leaves the backend at `STALE_VERSION` (see `finite.py`)."""
        if already_trained(self.model.version, samples, rollout_id):
            return dict(SKIPPED)
        with stale_on_failure(self.model, rollout_id):
            return self._train(samples, rollout_id)

    # -- partitioning ---------------------------------------------------------------------
    def partitions(self, samples: list[Sample]) -> list[list[int]]:
        """One epoch's optimizer steps: the groups in a seeded shuffle, cut into global-batch
        chunks. A group stays whole when the chunk size is a multiple of its size: its
        advantages are relative to each other, and a shared-prompt batch (the torch
        backend's) then computes its prompt once for all of its samples."""
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(samples):
            groups.setdefault(s.group_index, []).append(i)
        members = list(groups.values())
        order = [i for g in torch.randperm(len(members), generator=self.shuffle).tolist()
                 for i in members[g]]
        n = len(samples)
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

    def micro_batches(self, samples: list[Sample], idx: list[int]) -> list[MicroBatch]:
        """This DP rank's share of step `idx` (strided), cut by padded (or, packing, real)
        tokens, groups kept together where the backend shares prompts; a rank with no
        share gets one uncounted stand-in (see `MicroBatch`)."""
        m = self.model
        mine = idx[m.dp_rank :: m.dp_size]
        if not mine:
            return [MicroBatch(idx[:1], counted=False)]
        lengths = [len(samples[i].tokens) for i in mine]
        cfg = self.train_cfg
        groups = [samples[i].group_index for i in mine] if m.shares_prompts else None
        split = split_micro_batches(lengths, cfg.max_tokens_per_micro_batch,
                                    cfg.pack_sequences, groups)
        return [MicroBatch([mine[j] for j in mb]) for mb in split]

    # -- the step -------------------------------------------------------------------------
    def _scorers(self) -> Scorers:
        m, algo = self.model, self.algo_cfg

        def role(name: Role) -> Callable[[list[Sample]], list[Tensor]]:
            return lambda ss: m.score(name, ss)

        return Scorers(
            policy=role("policy"),
            ref=role("ref") if algo.uses_reference else None,
            teacher=role("teacher") if algo.use_opd else None,
            critic=role("critic") if algo.uses_critic else None,
        )

    def _train(self, samples: list[Sample], rollout_id: int) -> dict[str, float]:
        start = time.perf_counter()
        epochs = [self.partitions(samples) for _ in range(self.train_cfg.num_epochs_per_rollout)]
        full_steps = [idx for ep in epochs for idx in ep]
        with record_function("rollflow.prepare_batch"):
            prep = prepare_batch(
                samples, self.algo_cfg, self._scorers(), self.estimator, full_steps,
                self.reward_key, lazy=self.model.lazy_old_log_probs,
                skip_zero_gradient=self.train_cfg.skip_zero_gradient_samples,
            )
        uses_critic = self.algo_cfg.uses_critic
        train_actor = not (uses_critic and rollout_id < self.train_cfg.num_critic_only_steps)
        steps = []
        for idx, trained in zip(full_steps, prep.steps, strict=True):
            denominator = self._denominator(samples, idx)  # skipped samples count here
            out: dict[str, float] = {}
            if uses_critic:  # the value loss has a gradient on every sample
                loss = self._critic_loss(prep, denominator)
                mbs = self.micro_batches(samples, idx)
                out.update(self.model.optimizer_step("critic", samples, mbs, loss))
            if train_actor:
                loss = self._actor_loss(prep, denominator, self._denominator(samples, trained))
                mbs = self.micro_batches(samples, trained)
                out.update(self.model.optimizer_step("actor", samples, mbs, loss))
            steps.append(out)
        with record_function("rollflow.check_weights_finite"):
            self.model.check_weights_finite()
        elapsed = max(time.perf_counter() - start, 1e-9)
        self.model.version = rollout_id + 1
        # tokens the optimizer steps computed on: zero-gradient samples left out of the
        # actor's rows are not work done (a step that trained none has no throughput)
        rows = full_steps if uses_critic or not train_actor else prep.steps
        tokens = sum(len(samples[i].tokens) for step_rows in rows for i in step_rows)
        metrics = summarise(
            samples, prep.rewards, prep.advantages, prep.old_log_probs, steps,
            tokens / elapsed, self.model.version, self.algo_cfg.rollout_correction,
        ).to_dict()
        metrics["trained_tokens"] = float(tokens)
        if self.train_cfg.skip_zero_gradient_samples:
            metrics[ZERO_GRADIENT_SAMPLES] = float(prep.zero_gradient)
        return metrics

    # -- losses ---------------------------------------------------------------------------
    def _actor_loss(
        self, prep: PreparedBatch, denominator: float, trained_denominator: float
    ) -> MicroBatchLoss:
        """The step's actor loss over `denominator` (all of its samples); the metric terms a
        skipped sample would not have added 0 to are rescaled to the trained ones."""
        algo = self.algo_cfg
        loss_fn = self.custom_loss or actor_loss
        rescale = denominator / trained_denominator if trained_denominator else 1.0

        def micro_batch_loss(rows: list[int], fwd: Forward) -> tuple[Tensor, dict[str, Tensor]]:
            assert fwd.log_probs is not None and fwd.entropy is not None
            width, device = fwd.batch.targets.shape[1], fwd.log_probs.device
            old = None
            if prep.old_log_probs is not None:
                old = pad_response_values(_old_rows(prep, rows, fwd.log_probs), width).to(device)
            inputs = LossInputs(
                log_probs=fwd.log_probs,
                loss_mask=fwd.batch.loss_mask,
                entropy=fwd.entropy,
                old_log_probs=old,
                advantages=_rows(prep.advantages, rows, width, device),
                ref_log_probs=_rows(prep.ref_log_probs, rows, width, device),
                rollout_log_probs=_rows(prep.rollout_log_probs, rows, width, device),
            )
            loss, terms = loss_fn(algo, inputs, denominator)
            kl = _rows(prep.opd_reverse_kl, rows, width, device)
            if kl is not None:
                reduce = make_reducer(algo.calculate_per_token_loss, fwd.batch.loss_mask, denominator)
                terms = {**terms, "opd_reverse_kl": reduce(kl).detach()}
            if rescale != 1.0:
                terms = {k: v if k in EXACT_WITHOUT_SKIPPED else v * rescale
                         for k, v in terms.items()}
            if fwd.aux_loss is not None:  # a micro-batch mean: weighted by its share of the step
                rows_weight = (fwd.batch.loss_mask.sum() if algo.calculate_per_token_loss
                               else torch.tensor(float(len(rows))))
                aux = fwd.aux_loss * (rows_weight.to(fwd.aux_loss.device) / denominator)
                loss = loss + aux
                terms = {**terms, MOE_AUX_LOSS: aux.detach()}
            return loss, terms

        return micro_batch_loss

    def _critic_loss(self, prep: PreparedBatch, denominator: float) -> MicroBatchLoss:
        def micro_batch_loss(rows: list[int], fwd: Forward) -> tuple[Tensor, dict[str, Tensor]]:
            assert fwd.values is not None
            width, device = fwd.batch.targets.shape[1], fwd.values.device
            old_values = _rows(prep.values, rows, width, device)
            returns = _rows(prep.returns, rows, width, device)
            assert old_values is not None and returns is not None
            return critic_loss(
                self.algo_cfg, fwd.values, old_values, returns, fwd.batch.loss_mask, denominator
            )

        return micro_batch_loss


def _is_loss_and_terms(result: Any) -> bool:
    """What a custom loss must return: `(scalar loss tensor, {metric: tensor})`."""
    return (isinstance(result, tuple | list) and len(result) == 2
            and isinstance(result[0], Tensor) and result[0].numel() == 1
            and isinstance(result[1], Mapping))


def _rows(
    values: list[Tensor] | None, rows: list[int], width: int, device: torch.device
) -> Tensor | None:
    """Per-sample response values of `rows`, padded to `[len(rows), width]` on `device`."""
    if values is None:
        return None
    return to_device(pad_response_values([values[i] for i in rows], width), device)


def _old_rows(prep: PreparedBatch, rows: list[int], log_probs: Tensor) -> list[Tensor]:
    """Old log-probs of `rows`, filling (once) the lazy ones from the current forward, which
    runs before the first update (see `rollout_prep`)."""
    assert prep.old_log_probs is not None
    for r, i in enumerate(rows):
        if prep.old_log_probs[i] is None:  # kept on the device: no sync per micro-batch
            width = prep.response_lengths[i]
            prep.old_log_probs[i] = log_probs[r, :width].detach().float().clone()
    return [t for t in (prep.old_log_probs[i] for i in rows) if t is not None]
