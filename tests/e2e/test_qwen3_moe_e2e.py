"""A tiny Qwen3-MoE trained by GRPO through the train flow: embedded engine, torch trainer,
routing replay on (the engine's routed experts in rollout.arrow, replayed by the trainer)."""

from __future__ import annotations

import uuid

import pytest
import torch

from examples.arithmetic.build_model import save_tiny_model
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from tests.support.configs import arithmetic_config

pytestmark = pytest.mark.e2e


def test_qwen3_moe_grpo_with_routing_replay(prefect_api, ray_address, arithmetic_data, tmp_path):
    from transformers import AutoModelForCausalLM

    from flows.train import train

    model_dir = save_tiny_model(str(tmp_path / "qwen3-moe"), 2, 64, family="qwen3_moe")
    cfg = arithmetic_config(
        run_name=f"moe-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
        data=arithmetic_data, model_dir=model_dir, ray_address=ray_address, backend="embedded",
        overrides=["algorithm.routing_replay=true", "rollout.use_router=false",
                   "rollout.rollout_batch_size=2", "train.lr=0.01"],
    )
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0, 1]
    for k in (0, 1):
        metrics = layout.step_metrics(k)
        # replayed forwards route as the engine did: its log-probs are the trainer's
        assert metrics["train/rollout_logprob_abs_diff"] < 1e-4, metrics
        assert metrics["train/moe_aux_loss"] > 0.0
        rollout = read_samples(layout.store, f"steps/{k:06d}", "rollout.arrow")
        assert {s.weight_version for s in rollout} == {k}
        for s in rollout:  # every token but the last x 2 layers x top-2, ids of 8 experts
            assert s.routed_experts is not None and len(s.routed_experts) == (len(s.tokens) - 1) * 4
            assert s.routed_experts.ids.min() >= 0 and s.routed_experts.ids.max() < 8
    trained = layout.store.get_dir(str(tmp_path / "ckpt"), "checkpoints", "000001")
    reloaded = AutoModelForCausalLM.from_pretrained(trained)
    start = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    gate = "model.layers.0.mlp.gate.weight"
    assert not torch.equal(reloaded.state_dict()[gate], start.state_dict()[gate])  # the router learnt
