"""Resuming from a checkpoint continues exactly: the step after `load_checkpoint` (or
`train.load`) gives the same losses and weights as an uninterrupted backend, for GRPO with
an LR schedule and for PPO with a critic."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.train.torch_backend import TorchTrainBackend
from flows.config.run import AlgorithmConfig, TrainConfig
from tests.support.samples import make_backend, make_samples

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "grpo": (
        {"entropy_coef": 0.01},
        {"lr_warmup_steps": 2, "lr_decay_style": "cosine", "lr_decay_steps": 8, "min_lr": 1e-4},
    ),
    "ppo": (
        {"advantage_estimator": "ppo", "kl_coef": 0.05, "gamma": 0.99, "lambd": 0.95},
        {"critic_lr": 5e-4, "lr_warmup_steps": 1, "lr_decay_style": "linear", "lr_decay_steps": 10},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_continues_exactly(tiny_model_dir: str, tmp_path: Path, case: str) -> None:
    algo, extra = CASES[case]
    train_kw: dict[str, Any] = {"num_steps_per_rollout": 2, "num_epochs_per_rollout": 2, **extra}
    ckpt = os.path.join(str(tmp_path), "ckpt")
    first, second = make_samples(8, seed=1), make_samples(8, seed=2)

    uninterrupted = make_backend(tiny_model_dir, algo, **train_kw)
    uninterrupted.train(first, 0)
    uninterrupted.save_checkpoint(ckpt)
    expected = uninterrupted.train(second, 1)

    files: tuple[str, ...] = ("optimizer.pt", "scheduler.pt", "rng.pt", "meta.json")
    if case == "ppo":
        files += ("critic/value_head.pt", "critic_optimizer.pt", "critic_scheduler.pt")
        assert expected["critic/value_loss"] > 0
    for name in files:
        assert os.path.exists(os.path.join(ckpt, name)), name
    # the schedule moved on: 4 steps done, so the resumed lr is not the initial one
    assert expected["lr"] != pytest.approx(1e-3)

    resumed = make_backend(tiny_model_dir, algo, **train_kw)
    resumed.load_checkpoint(ckpt)
    got = resumed.train(second, 1)
    keys = [k for k in expected if k not in ("train_tokens_per_s",)]
    for key in keys:
        assert got[key] == pytest.approx(expected[key], abs=1e-6, nan_ok=True), key
    a, b = uninterrupted.state_dict_for_engine(), resumed.state_dict_for_engine()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    if case == "ppo":
        assert uninterrupted.critic_model is not None and resumed.critic_model is not None
        ca, cb = uninterrupted.critic_model.state_dict(), resumed.critic_model.state_dict()
        assert all(torch.allclose(ca[k], cb[k], atol=1e-6) for k in ca)

    from_load = TorchTrainBackend(
        TrainConfig.model_validate(
            {"model_path": tiny_model_dir, "load": ckpt, "lr": 1e-3, "seed": 7, **train_kw}
        ),
        AlgorithmConfig.model_validate(algo),
        num_threads=1,
    )
    assert from_load.version == 1
    assert from_load.train(second, 1)["loss"] == pytest.approx(expected["loss"], abs=1e-6)
