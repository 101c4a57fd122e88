"""HF <-> megatron weight conversion (pure torch, no megatron needed): exact round trips
through the fused layout, TP shards, EP ranks and PP stages, the fused row order itself, and
for each family the names and shapes it maps (Qwen3's q/k norms, Qwen3-MoE's router and
experts)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from engines.train.megatron.hf_convert import (
    ModelShape,
    check_ep,
    check_tp,
    expert_tensors,
    fuse_qkv,
    hf_to_mcore,
    mcore_to_hf,
    merge_ep,
    merge_stages,
    merge_tp,
    select_stage,
    shard_ep,
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


def _moe() -> tuple[Any, dict[str, torch.Tensor], ModelShape]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                         moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_experts=4,
                         num_experts_per_tok=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    return model, model.state_dict(), ModelShape.from_hf_config(cfg)


def test_qwen3_moe_router_and_experts_map_to_sequential_mlp() -> None:
    _, hf, shape = _moe()
    assert (shape.num_experts, shape.moe_topk, shape.moe_ffn_hidden_size) == (4, 2, 24)
    assert shape.qk_layernorm and shape.is_moe
    full = hf_to_mcore(hf, shape)
    src = "model.layers.1.mlp."
    assert full["decoder.layers.1.mlp.router.weight"] is hf[src + "gate.weight"]
    gate_up, down = hf[src + "experts.gate_up_proj"], hf[src + "experts.down_proj"]
    for e in range(4):
        fc1 = full[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1.weight"]
        fc2 = full[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2.weight"]
        assert fc1.shape == (2 * 24, 32) and fc2.shape == (32, 24)
        # fc1 = [gate_e; up_e]: HF's fused gate_up_proj holds the gate rows first
        assert torch.equal(fc1, gate_up[e]) and torch.equal(fc2, down[e])
    assert not any("linear_fc1" in k and "local_experts" not in k for k in full)  # no dense MLP
    back = mcore_to_hf(full, shape)
    assert set(back) == set(hf) and all(torch.equal(back[k], v) for k, v in hf.items())


def test_qwen3_moe_per_expert_names_on_disk_are_read_too(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model, hf, shape = _moe()
    model.save_pretrained(tmp_path)
    disk = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in disk  # per expert on disk
    from_disk, from_memory = hf_to_mcore(disk, shape), hf_to_mcore(hf, shape)
    assert set(from_disk) == set(from_memory)
    assert all(torch.equal(from_disk[k], from_memory[k]) for k in from_memory)


def test_expert_parallel_ranks_hold_whole_experts_renumbered() -> None:
    _, hf, shape = _moe()
    full = hf_to_mcore(hf, shape)
    shards = [shard_ep(full, r, 2, shape.num_experts) for r in range(2)]
    name = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    assert torch.equal(shards[1][name.format(0)], full[name.format(2)])  # global 2 = local 0
    assert name.format(2) not in shards[1] and name.format(2) not in shards[0]
    assert shards[1]["decoder.layers.0.mlp.router.weight"] is full["decoder.layers.0.mlp.router.weight"]
    # the other ranks may hand over their experts only (parallel.gather_full_state)
    merged = merge_ep([shards[0], expert_tensors(shards[1])])
    assert set(merged) == set(full) and all(torch.equal(merged[k], full[k]) for k in full)
    # TP shards the experts as dense MLPs (fc1 [gate_r; up_r], fc2 by columns)
    tp = shard_tp(full, 1, 2)
    gate, up = torch.chunk(full[name.format(3)], 2)
    assert torch.equal(tp[name.format(3)], torch.cat([gate[12:], up[12:]]))


def test_expert_parallel_sizes_are_checked_by_name() -> None:
    _, _, shape = _moe()
    check_ep(shape, 4)
    with pytest.raises(ValueError, match="num_experts=4 is not divisible by train.expert_parallel=3"):
        check_ep(shape, 3)
    _, dense = _model()
    with pytest.raises(ValueError, match="needs an MoE model"):
        check_ep(dense, 2)
    with pytest.raises(ValueError, match="moe_intermediate_size=24 is not divisible by tensor parallel 5"):
        check_tp(replace(shape, num_heads=5, num_kv_heads=5, ffn_hidden_size=5, vocab_size=5), 5)


def test_moe_with_dense_layers_is_refused() -> None:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(num_hidden_layers=2, num_experts=4, mlp_only_layers=[0])
    with pytest.raises(ValueError, match="mlp_only_layers"):
        ModelShape.from_hf_config(cfg)
