"""Colocated mode: the trainer is offloaded while the engine generates and the engine's
memory is released while the trainer trains; nothing about the results may change."""

from __future__ import annotations

import uuid

import pytest
import ray
import torch
from safetensors.torch import load_file

from engines.cluster.actors import kill_run_actors
from engines.cluster.registry import get_run_actor
from storage.run_layout import RunLayout
from tests.support.configs import arithmetic_config

pytestmark = pytest.mark.e2e


def test_colocated_run_matches_the_plain_run(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    from flows.train import train

    def run(name, *extra):
        cfg = arithmetic_config(
            run_name=f"{name}-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
            data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
            backend="embedded", overrides=["train.lr=0.01", "cluster.keep_actors=true", *extra],
        )
        try:
            train(cfg)
            trainer = get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, "trainer")
            phases = ray.get(trainer.phases.remote())
        finally:
            kill_run_actors(cfg)
        return RunLayout.open(cfg.storage.uri, cfg.storage.run_name), phases

    (plain, plain_phases), (colocated, phases) = run("plain"), run("colo", "cluster.colocate=true")
    # each step: the trainer gave its memory up before the engines generated, took it back
    # before training; the plain run's trainer never moved
    assert phases == [p for k in (0, 1) for p in ("offload", "onload", f"train {k}")], phases
    assert plain_phases == ["train 0", "train 1"], plain_phases
    for k in (0, 1):
        a, b = plain.step_metrics(k), colocated.step_metrics(k)
        assert b["train/rollout_logprob_abs_diff"] < 1e-3  # engine weights came back intact
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7)
    weights_a = load_file(f"{plain.uri}/checkpoints/000001/model.safetensors")
    weights_b = load_file(f"{colocated.uri}/checkpoints/000001/model.safetensors")
    for name, value in weights_a.items():
        torch.testing.assert_close(weights_b[name], value, rtol=1e-5, atol=1e-6)
