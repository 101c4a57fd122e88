"""Shared inputs of the GPU tests: tiny HF models on disk and reproducible GRPO samples."""

from __future__ import annotations

import random

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
