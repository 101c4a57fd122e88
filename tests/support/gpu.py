"""Shared inputs of the GPU tests: tiny HF models on disk, reproducible GRPO samples, the
NCCL settings of a shared host and the train-group config of the worker script."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from storage.sample import Sample


def save_qwen2_tiny(path: str, tie_word_embeddings: bool = False, seed: int = 0) -> str:
    """A random Qwen2-shaped model (GQA, q/k/v biases) whose every split dim divides by 2."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def save_qwen3_tiny(path: str, moe: bool = False, seed: int = 0) -> str:
    """A random Qwen3-shaped model (per-head q/k norms, GQA, head_dim not hidden / heads),
    or (`moe`) Qwen3-MoE-shaped with 8 experts, 2 per token, every split dim divisible by 2.
    No load-balancing loss: the megatron backend adds none, so torch must not either for the
    two to agree."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=48, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    cfg = (Qwen3MoeConfig(intermediate_size=256, moe_intermediate_size=64, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.0,
                          **common)
           if moe else Qwen3Config(intermediate_size=256, **common))
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def grpo_samples(n_groups: int = 4, group: int = 4, vocab: int = 256, seed: int = 0) -> list[Sample]:
    """Groups of random prompt + response tokens, 0/1 rewards, one masked token per group."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 9))]
        for j in range(group):
            resp = [rng.randrange(1, vocab) for _ in range(rng.randint(2, 12))]
            mask = [1] * len(resp)
            mask[0] = 0 if j == 1 else 1  # a masked token somewhere
            out.append(Sample(
                index=g * group + j, group_index=g, tokens=prompt + resp,
                response_length=len(resp), loss_mask=mask, reward=float(rng.random() > 0.5),
            ))
    return out


REPO = Path(__file__).resolve().parents[2]  # the checkout: the worker scripts' PYTHONPATH

# NVLink multicast must stay off on shared hosts (see the device notes); harmless elsewhere.
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}

needs_two = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)


def group_config(runs_root: str, model_dir: str, run_name: str, weight_sync: str) -> Any:
    """A run config for a TP=2 megatron trainer of the tiny Qwen2 model (2 ranks)."""
    from flows.config.loader import config_from_dict

    return config_from_dict({
        "data": {"prompt_data": "unused.jsonl"},
        "rollout": {"num_rollout": 1, "rollout_batch_size": 4, "n_samples_per_prompt": 2},
        "engine": {"backend": "mock"},
        "cluster": {"actor_num_gpus_per_node": 2},
        "train": {"backend": "megatron", "tensor_parallel": 2, "model_path": model_dir,
                  "lr": 1e-3, "max_tokens_per_micro_batch": 64, "weight_sync": weight_sync,
                  "weight_sync_backend": "gloo"},
        "storage": {"uri": runs_root, "run_name": run_name},
    })


def write_step(cfg: Any, rollout_id: int = 0) -> None:
    from storage.batch_io import write_samples
    from storage.run_layout import RunLayout, step_dir

    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    write_samples(layout.store, grpo_samples(), step_dir(rollout_id), "train.arrow")
