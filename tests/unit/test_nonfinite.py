"""Non-finite values never reach the weights: rewards refused, steps skipped, weights checked."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from torch import Tensor

from engines.algorithms.losses import LossInputs
from engines.train.distributed import DataParallel
from engines.train.finite import STALE_VERSION, NonFiniteError
from engines.train.optim_step import OptimizedModel, optimizer_step
from engines.train.step_model import MicroBatch
from flows.config.run import AlgorithmConfig
from storage.batch_io import write_samples
from storage.object_store import ObjectStore
from storage.sample import RewardError, Sample
from tests.support.samples import make_backend, make_samples


# -- rewards --------------------------------------------------------------------------------
def scored(reward: object, **metadata: object) -> Sample:
    return Sample(index=7, group_index=1, reward=reward, metadata=dict(metadata))  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "1.0"])
def test_non_finite_reward_names_sample_line_and_hook(bad: object) -> None:
    s = scored(bad, source_line=42)
    with pytest.raises(RewardError, match=r"sample 7 \(prompt line 42\): reward is .*my_rm"):
        s.check_reward(source="my_rm")
    with pytest.raises(RewardError, match="sample 7"):
        s.scalar_reward()


def test_dict_reward_checks_every_number_and_ignores_side_fields() -> None:
    scored({"acc": 1.0, "pred": "42"}).check_reward()
    s = scored({"acc": 1.0, "format": math.nan}, rm_type="dapo")
    with pytest.raises(RewardError, match=r"reward\['format'\] is nan.*returned by dapo"):
        s.scalar_reward("acc")  # even though the trained key is finite


def test_missing_reward_is_fine_until_trained_on() -> None:
    scored(None).check_reward()
    with pytest.raises(RewardError, match="reward is missing"):
        scored(None).scalar_reward()


def test_a_batch_with_a_nan_reward_is_never_written(tmp_path: Path) -> None:
    store = ObjectStore(str(tmp_path))
    batch = [Sample(index=i, group_index=0, reward=1.0) for i in range(4)]
    batch[2].reward = math.nan
    with pytest.raises(RewardError, match="sample 2"):
        write_samples(store, batch, "steps", "rollout.arrow")
    assert not store.exists("steps", "rollout.arrow")


# -- the optimizer step ---------------------------------------------------------------------
def linear_opt() -> OptimizedModel:
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(module.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    return OptimizedModel(module, opt, sched, clip_grad=1.0)


def step(opt: OptimizedModel, nan_grads: bool = False, nan_loss: bool = False) -> dict[str, float]:
    def loss_fn(rows: list[int]) -> tuple[Tensor, dict[str, Tensor]]:
        x = torch.ones(len(rows), 3)
        loss = opt.module(x).pow(2).mean() * (math.nan if nan_loss else 1.0)
        if nan_grads:  # the loss stays finite; its gradient does not
            loss = loss + torch.sqrt(loss - loss)
        return loss, {"loss": loss.detach()}

    return optimizer_step(opt, [MicroBatch([0, 1])], loss_fn, DataParallel(), torch.device("cpu"))


def snapshot(module: torch.nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_non_finite_grad_norm_skips_the_step_and_counts_it() -> None:
    opt = linear_opt()
    before = snapshot(opt.module)
    out = step(opt, nan_grads=True)
    assert out["skipped_steps"] == 1.0 and "grad_norm" not in out
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(opt.module), strict=True))
    assert not opt.optimizer.state and opt.scheduler.last_epoch == 0  # nothing advanced
    out = step(opt)
    assert out["skipped_steps"] == 0.0 and math.isfinite(out["grad_norm"])
    assert not torch.equal(before[0], snapshot(opt.module)[0])


def test_a_run_of_skipped_steps_fails_loudly() -> None:
    opt = linear_opt()
    opt.max_consecutive_skips = 3
    step(opt, nan_grads=True)
    step(opt, nan_grads=True)
    step(opt)  # a good step in between resets the run
    assert opt.consecutive_skips == 0
    step(opt, nan_grads=True)
    step(opt, nan_grads=True)
    with pytest.raises(NonFiniteError, match="not finite for 3 optimizer steps in a row"):
        step(opt, nan_grads=True)


def test_non_finite_loss_raises_without_stepping() -> None:
    opt = linear_opt()
    before = snapshot(opt.module)
    with pytest.raises(NonFiniteError, match="actor loss is nan"):
        step(opt, nan_loss=True)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(opt.module), strict=True))


# -- the torch backend ----------------------------------------------------------------------
def _nan_grad_loss(algo: AlgorithmConfig, inputs: LossInputs, denominator: float) -> tuple:
    """A finite NLL whose gradient is NaN (d sqrt(x - x) = inf * 0)."""
    nll = -(inputs.log_probs * inputs.loss_mask).sum() / denominator
    loss = nll + torch.sqrt(nll - nll)
    return loss, {"loss": loss.detach()}


def test_backend_counts_skipped_steps_and_keeps_its_weights(tiny_model_dir: str) -> None:
    algo = {"loss_type": "custom_loss",
            "custom_loss_function_path": "tests.unit.test_nonfinite:_nan_grad_loss"}
    backend = make_backend(tiny_model_dir, algo, global_batch_size=4)
    before = snapshot(backend.model)
    metrics = backend.train(make_samples(8), 0)
    assert metrics["skipped_steps"] == 2.0 and metrics["num_optimizer_steps"] == 2.0
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(backend.model), strict=True))
    assert backend.version == 1  # nothing non-finite was learned; the run goes on


def test_backend_refuses_to_produce_non_finite_weights(tiny_model_dir: str, tmp_path: Path) -> None:
    backend = make_backend(tiny_model_dir)
    first = next(backend.model.parameters())
    # An update that overflows (fp16/bf16 range, a huge learning rate), after a finite grad.
    def overflow(*_: object) -> None:
        first.data.fill_(math.inf)

    backend.actor.optimizer.register_step_post_hook(overflow)
    with pytest.raises(NonFiniteError, match="rollout 0: weights after training"):
        backend.train(make_samples(8), 0)
    assert backend.version == STALE_VERSION  # the actor rebuilds it before training again
    with pytest.raises(RuntimeError, match="failed part-way"):
        backend.train(make_samples(8), 0)
    with pytest.raises(NonFiniteError, match="weights for the engines"):
        backend.state_dict_for_engine()
    with pytest.raises(NonFiniteError, match="checkpoint"):
        backend.save_checkpoint(str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt")
