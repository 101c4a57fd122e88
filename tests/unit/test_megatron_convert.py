"""HF <-> megatron weight conversion (pure torch, no megatron needed): exact round trips
through the fused layout, TP shards and PP stages, and the fused row order itself."""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from engines.train.megatron.hf_convert import (
    ModelShape,
    fuse_qkv,
    hf_to_mcore,
    mcore_to_hf,
    merge_stages,
    merge_tp,
    select_stage,
    shard_tp,
    stage_layers,
)


def _model() -> tuple[dict[str, torch.Tensor], ModelShape]:
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).state_dict(), ModelShape.from_hf_config(cfg)


def test_qkv_rows_are_grouped_per_kv_head() -> None:
    _, shape = _model()  # 4 heads, 2 kv groups, head_dim 8
    q = torch.arange(32).float().unsqueeze(-1)  # q rows 0..31 (heads 0..3)
    k = 100 + torch.arange(16).float().unsqueeze(-1)
    v = 200 + torch.arange(16).float().unsqueeze(-1)
    rows = fuse_qkv(q, k, v, shape).squeeze(-1).tolist()
    # group 0: q heads 0,1 (rows 0..15), k_0 (100..107), v_0 (200..207); then group 1.
    assert rows[:16] == list(range(16)) and rows[16:24] == [100.0 + i for i in range(8)]
    assert rows[24:32] == [200.0 + i for i in range(8)] and rows[32] == 16.0


def test_hf_megatron_round_trip_is_exact() -> None:
    hf, shape = _model()
    back = mcore_to_hf(hf_to_mcore(hf, shape), shape)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], v) for k, v in hf.items())


def test_tp_and_pp_round_trip_is_exact() -> None:
    hf, shape = _model()
    full = hf_to_mcore(hf, shape)
    stages = []
    for pp_rank in range(2):
        layers = stage_layers(shape.num_layers, pp_rank, 2)
        stage = select_stage(full, layers, pp_rank == 0, pp_rank == 1)
        shards = [shard_tp(stage, r, 2) for r in range(2)]
        fc1 = shards[1]["decoder.layers.0.mlp.linear_fc1.weight"]
        gate, up = torch.chunk(full[f"decoder.layers.{layers.start}.mlp.linear_fc1.weight"], 2)
        assert torch.equal(fc1, torch.cat([gate[24:], up[24:]]))  # [gate_r; up_r] per rank
        stages.append((layers.start, merge_tp(shards)))
    merged = merge_stages(stages)
    assert set(merged) == set(full) and all(torch.equal(merged[k], full[k]) for k in full)


def test_qwen3_q_and_k_norms_map_to_megatron_qk_layernorm() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(cfg).state_dict()
    shape = ModelShape.from_hf_config(cfg)
    assert shape.qk_layernorm and not shape.qkv_bias and shape.head_dim == 16  # not 32 / 4
    full = hf_to_mcore(hf, shape)
    q_norm = full["decoder.layers.1.self_attention.q_layernorm.weight"]
    assert q_norm is hf["model.layers.1.self_attn.q_norm.weight"] and q_norm.shape == (16,)
    assert full["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (4 * 16 + 2 * 2 * 16, 32)
    back = mcore_to_hf(full, shape)
    assert set(back) == set(hf) and all(torch.equal(back[k], v) for k, v in hf.items())
    # the norms are whole on every TP rank
    shard = shard_tp(full, 1, 2)
    assert torch.equal(shard["decoder.layers.0.self_attention.k_layernorm.weight"],
                       hf["model.layers.0.self_attn.k_norm.weight"])
