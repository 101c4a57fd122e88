"""torch vs megatron on every algorithm: two `train()` calls each from identical weights and
samples, then the largest differences (used by tests/gpu/test_megatron_parity.py; importable without
a GPU, so the same comparison can run wherever megatron runs).

Per case: loss (max |diff| over the two calls), grad_norm (relative), log-probs after
training, and the exported HF weights after training, both as max |diff| and as the worst
tensor's |diff| / |update| (Adam's early steps are ~lr * sign(grad), so noise in near-zero
gradients moves single elements by up to 2 lr while the tensor as a whole agrees).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from storage.sample import Sample
from tests.support.gpu import grpo_samples

CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # name: (algorithm, train)
    "grpo": ({}, {}),
    "grpo+kl_loss+entropy": ({"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01}, {}),
    "grpo per-token loss": ({"calculate_per_token_loss": True}, {}),
    "gspo": ({"advantage_estimator": "gspo"}, {}),
    "ppo+critic": ({"advantage_estimator": "ppo", "lambd": 0.95}, {"critic_lr": 2e-3}),
    "reinforce++ (kl reward)": ({"advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.05}, {}),
    "reinforce++ baseline": ({"advantage_estimator": "reinforce_plus_plus_baseline"}, {}),
    "rloo": ({"advantage_estimator": "rloo", "normalize_advantages": True}, {}),
    "ppo+critic, kl reward": ({"advantage_estimator": "ppo", "kl_coef": 0.05}, {}),
    "opd": ({"use_opd": True, "opd_kl_coef": 0.5}, {}),
    "tis": ({"rollout_correction": {"mode": "token_tis", "high": 1.5}}, {}),
    "rollout logprobs": ({"use_rollout_logprobs": True}, {}),
    "lr warmup+cosine, 3 steps": ({}, {"lr_warmup_steps": 2, "lr_decay_style": "cosine",
                                       "lr_decay_steps": 5, "min_lr": 1e-4,
                                       "global_batch_size": None, "num_steps_per_rollout": 3}),
    "sft, 2 epochs": ({"loss_type": "sft_loss"}, {"num_epochs_per_rollout": 2}),
}
MOE_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # random recorded experts, not the model's own: both backends must route by them
    "grpo+routing_replay": ({"routing_replay": True}, {}),
}
KEYS = ("loss", "pg_loss", "kl_loss", "entropy", "approx_kl", "clipfrac")


def parity_samples(seed: int = 0) -> list[Sample]:
    """GRPO samples with engine log-probs near the policy's (correction / rollout-logprob cases)."""
    rng = random.Random(seed)
    samples = grpo_samples(seed=seed)
    for s in samples:
        s.rollout_log_probs = [-5.5 + rng.uniform(-0.3, 0.3) for _ in range(s.response_length)]
    return samples


def with_random_routing(samples: list[Sample], model_dir: str, seed: int = 0) -> list[Sample]:
    """`samples` with routed experts for every token but the last: k distinct random experts
    per layer (MoE model `model_dir`), as an engine's `routed_experts` would come."""
    import numpy as np
    from transformers import AutoConfig

    from storage.sample import RoutedExperts

    cfg = AutoConfig.from_pretrained(model_dir)
    layers, k, experts = cfg.num_hidden_layers, cfg.num_experts_per_tok, cfg.num_experts
    rng = np.random.default_rng(seed)
    for s in samples:
        ids = np.stack([rng.permutation(experts)[:k] for _ in range((len(s.tokens) - 1) * layers)])
        s.routed_experts = RoutedExperts.of(ids.astype(np.int16).reshape(-1))
    return samples


def configs(name: str, model_dir: str, teacher_dir: str) -> tuple[Any, Any]:
    from flows.config.run import AlgorithmConfig, TrainConfig

    algo, train = {**CASES, **MOE_CASES}[name]
    if algo.get("use_opd"):
        algo = {**algo, "opd_teacher_path": teacher_dir}
    train = {"model_path": model_dir, "lr": 1e-3, "global_batch_size": 8,
             "max_tokens_per_micro_batch": 64, "seed": 7, **train}
    return TrainConfig.model_validate(train), AlgorithmConfig.model_validate(algo)


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
           before: dict[str, torch.Tensor]) -> tuple[float, float]:
    """(max |a - b|, worst per-tensor |a - b| / |b - before|) over the HF tensors."""
    absd, rel = 0.0, 0.0
    for k, ref in b.items():
        diff = a[k].float() - ref.float()
        absd = max(absd, float(diff.abs().max()))
        update = (ref.float() - before[k].float()).norm().clamp_min(1e-12)
        rel = max(rel, float(diff.norm() / update))
    return absd, rel


def compare(name: str, model_dir: str, teacher_dir: str) -> dict[str, Any]:
    """One row of the parity table (see the module docstring)."""
    from engines.train.megatron import MegatronTrainBackend
    from engines.train.torch_backend import TorchTrainBackend

    train, algo = configs(name, model_dir, teacher_dir)
    samples = parity_samples()
    if algo.routing_replay:
        samples = with_random_routing(samples, model_dir)
    mg, tb = MegatronTrainBackend(train, algo), TorchTrainBackend(train, algo)
    before = tb.state_dict_for_engine()
    loss, grad, terms = 0.0, 0.0, 0.0
    for step in range(2):
        m, t = mg.train(samples, step), tb.train(samples, step)
        loss = max(loss, abs(m["loss"] - t["loss"]))
        terms = max(terms, *(abs(m[k] - t[k]) for k in KEYS))
        if "grad_norm" in t:
            grad = max(grad, abs(m["grad_norm"] - t["grad_norm"]) / max(t["grad_norm"], 1e-12))
        if "critic/value_loss" in t:
            terms = max(terms, abs(m["critic/value_loss"] - t["critic/value_loss"]))
        if "lr" in t:
            assert abs(m["lr"] - t["lr"]) < 1e-12, (name, step, m["lr"], t["lr"])
    lp = max(float((torch.tensor(a) - torch.tensor(b)).abs().max())
             for a, b in zip(mg.compute_log_probs(samples), tb.compute_log_probs(samples),
                             strict=True))
    w_abs, w_rel = _worst(mg.state_dict_for_engine(), tb.state_dict_for_engine(), before)
    return {"case": name, "loss": loss, "terms": terms, "grad_norm_rel": grad,
            "logprobs": lp, "weights_abs": w_abs, "weights_rel_update": w_rel}


def table(rows: list[dict[str, Any]]) -> str:
    head = ("case", "loss", "terms", "grad_norm_rel", "logprobs", "weights_abs",
            "weights_rel_update")
    lines = [" | ".join(f"{h:>26}" if i == 0 else f"{h:>12}" for i, h in enumerate(head))]
    for r in rows:
        lines.append(" | ".join(f"{r[h]:>26}" if i == 0 else f"{r[h]:12.2e}"
                                for i, h in enumerate(head)))
    return "\n".join(lines)
