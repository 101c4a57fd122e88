"""The shared train step (engines/train/step.py) against a model-free `StepModel`: what a
backend is asked to do, in which order, on which rows, and how its answers are summarised."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from engines.algorithms.config import AlgorithmConfig
from engines.train.batching import build_padded_batch
from engines.train.config import TrainConfig
from engines.train.step import TrainStep
from engines.train.step_model import PREFIX, Forward, MicroBatch, MicroBatchLoss, Part, Role
from storage.sample import Sample
from tests.unit.test_torch_backend import make_samples


class FakeModel:
    """A `StepModel` whose log-probs / values are a trainable scalar per part; it records
    every call, and skips the optimizer steps listed in `skip`."""

    def __init__(self, dp_rank: int = 0, dp_size: int = 1, skip: tuple[int, ...] = ()) -> None:
        self.version = 0
        self._rank, self._size, self.skip = dp_rank, dp_size, skip
        self.weights = {"actor": torch.zeros((), requires_grad=True),
                        "critic": torch.zeros((), requires_grad=True)}
        self.calls: list[tuple[str, list[MicroBatch]]] = []
        self.scored: list[tuple[str, int]] = []

    @property
    def dp_rank(self) -> int:
        return self._rank

    @property
    def dp_size(self) -> int:
        return self._size

    @property
    def lazy_old_log_probs(self) -> bool:
        return self._size == 1

    @property
    def shares_prompts(self) -> bool:
        return False

    def score(self, role: Role, samples: list[Sample]) -> list[Tensor]:
        self.scored.append((role, len(samples)))
        return [torch.full((s.response_length,), -1.0) for s in samples]

    def optimizer_step(self, part: Part, samples: list[Sample], micro_batches: list[MicroBatch],
                       loss_fn: MicroBatchLoss) -> dict[str, float]:
        self.calls.append((part, micro_batches))
        w, out = self.weights[part], {}
        for mb in micro_batches:
            batch = build_padded_batch([samples[i] for i in mb.rows])
            x = w.expand(batch.targets.shape) - 1.0
            fwd = (Forward(batch, values=x) if part == "critic"
                   else Forward(batch, log_probs=x, entropy=torch.zeros_like(x)))
            loss, terms = loss_fn(mb.rows, fwd)
            if mb.counted:
                out.update({PREFIX[part] + k: out.get(PREFIX[part] + k, 0.0) + float(v)
                            for k, v in terms.items()})
        skipped = len(self.calls) - 1 in self.skip
        if not skipped:
            out[PREFIX[part] + "grad_norm"] = 1.0
        out[PREFIX[part] + "skipped_steps"] = float(skipped)
        return out

    def check_weights_finite(self) -> None:
        pass


def _step(model: FakeModel, algo: dict[str, object] | None = None, **train: object) -> TrainStep:
    cfg = TrainConfig.model_validate({"max_tokens_per_micro_batch": 10**6, **train})
    return TrainStep(cfg, AlgorithmConfig.model_validate(algo or {}), model,
                     torch.Generator().manual_seed(0))


def test_steps_follow_num_steps_per_rollout_and_cover_every_sample() -> None:
    model = FakeModel()
    metrics = _step(model, num_steps_per_rollout=3).train(make_samples(10), 0)
    rows = [[i for mb in mbs for i in mb.rows] for _, mbs in model.calls]
    assert [len(r) for r in rows] == [4, 4, 2] and metrics["num_optimizer_steps"] == 3.0
    assert sorted(i for r in rows for i in r) == list(range(10))


def test_a_rank_without_samples_runs_one_uncounted_stand_in() -> None:
    samples = make_samples(8)
    step = _step(FakeModel(dp_rank=2, dp_size=3))
    assert [mb.rows for mb in step.micro_batches(samples, [5, 1, 7])] == [[7]]
    assert step.micro_batches(samples, [5, 1]) == [MicroBatch([5], counted=False)]


def test_critic_steps_first_and_alone_during_critic_only_rollouts() -> None:
    model = FakeModel()
    step = _step(model, {"advantage_estimator": "ppo"}, num_critic_only_steps=1,
                 global_batch_size=4)
    metrics = step.train(make_samples(8), 0)
    assert [part for part, _ in model.calls] == ["critic", "critic"]
    assert "critic/value_loss" in metrics and metrics["num_optimizer_steps"] == 2.0
    assert ("critic", 8) in model.scored and model.version == 1
    step.train(make_samples(8), 1)
    assert [part for part, _ in model.calls[2:]] == ["critic", "actor", "critic", "actor"]


def test_summary_averages_a_key_over_the_steps_that_report_it() -> None:
    """A skipped step has no grad_norm: the mean is over the others, not a 0 in the mean."""
    model = FakeModel(skip=(0,))
    metrics = _step(model, global_batch_size=2).train(make_samples(8), 0)
    assert metrics["grad_norm"] == 1.0 and metrics["skipped_steps"] == 1.0
    assert metrics["num_optimizer_steps"] == 4.0 and math.isfinite(metrics["loss"])


def test_lazy_old_log_probs_skip_the_first_steps_scoring() -> None:
    lazy, eager = FakeModel(), FakeModel(dp_size=2)
    _step(lazy, global_batch_size=4).train(make_samples(8), 0)
    _step(eager, global_batch_size=4).train(make_samples(8), 0)
    assert lazy.scored == [("policy", 4)]  # the first step's 4 come from its own forward
    assert eager.scored == [("policy", 4), ("policy", 4)]  # first step alone, then the rest
    with pytest.raises(RuntimeError, match="failed part-way"):
        lazy.version = -1
        _step(lazy).train(make_samples(8), 1)
