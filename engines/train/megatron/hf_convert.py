"""HF <-> megatron-core weight conversion for Llama / Qwen2 / Qwen3 / Qwen3-MoE (pure torch).

Megatron fuses what HF keeps apart, and orders the fused rows so that a tensor-parallel
split along dim 0 gives each rank whole heads / whole halves:

* `linear_qkv` = per KV group g: [q heads of g (heads_per_group * d rows); k_g (d); v_g (d)],
  groups one after another. HF keeps `q_proj`, `k_proj`, `v_proj` (and their biases).
* `linear_fc1` = [gate; up] *per TP rank*: rank r holds [gate_r; up_r], so the full (TP=1)
  tensor is [gate; up] and a TP shard is built from the gate and up shards separately.

Qwen3 normalises each head's queries and keys before RoPE (HF `q_norm` / `k_norm`, one
`[head_dim]` weight each, shared by the heads): megatron-core's `qk_layernorm=True`, whose
`q_layernorm` / `k_layernorm` weights are replicated across TP ranks.

Qwen3-MoE replaces each layer's MLP by a router and experts: HF `mlp.gate.weight` is
megatron's `mlp.router.weight` (`[experts, hidden]`, replicated), and expert e's weights are
`mlp.experts.local_experts.{e}.linear_fc1` (= [gate_e; up_e], as a dense fc1) and `.linear_fc2`
(= down_e) of megatron's `SequentialMLP`. transformers >= 5 holds the experts of a layer fused
in memory (`mlp.experts.gate_up_proj` `[experts, 2 * ffn, hidden]`, gate rows first, and
`mlp.experts.down_proj` `[experts, hidden, ffn]`) and writes them per expert on disk
(`mlp.experts.{e}.gate_proj.weight`, ...); `hf_to_mcore` reads either, `mcore_to_hf` gives the
fused names, those of the model's own `state_dict()`.

This converter, not a bridge library: `mbridge` fails against megatron-core 0.19's model
types and `megatron-bridge` needs Transformer Engine, which the GPU image lacks; a mapping per
family with a round-trip test (tests/unit/test_megatron_convert.py) is small and checked.

The functions below work on *full* (unsharded, all layers) state dicts; `shard_tp` /
`merge_tp`, `shard_ep` / `merge_ep` and `select_stage` / `merge_stages` cut and reassemble
them for TP, expert parallelism (whole experts per rank) and PP.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from engines.weights.model_families import check_model_family

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^(.+\.mlp\.experts\.local_experts\.)(\d+)\.(.+)$")


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The architecture numbers both sides agree on (read from an HF config)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    qkv_bias: bool
    tie_word_embeddings: bool
    qk_layernorm: bool
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_experts: int = 0  # 0: a dense model
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelShape:
        """Qwen2 always has q/k/v biases; Llama and Qwen3 have them when `attention_bias`
        is set; Qwen3 normalises q and k per head."""
        model_type = getattr(cfg, "model_type", None)
        check_model_family(model_type, "megatron", "megatron model config")
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        moe = model_type == "qwen3_moe"
        if moe and (int(getattr(cfg, "decoder_sparse_step", 1)) != 1
                    or getattr(cfg, "mlp_only_layers", None)):
            raise ValueError(
                "megatron model config: Qwen3-MoE with dense layers among the sparse ones "
                "(decoder_sparse_step != 1 or mlp_only_layers) is not supported; every "
                "layer must be an MoE layer"
            )
        return cls(
            num_layers=int(cfg.num_hidden_layers),
            hidden_size=int(cfg.hidden_size),
            num_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            ffn_hidden_size=int(cfg.intermediate_size),
            vocab_size=int(cfg.vocab_size),
            qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope_theta=float(theta),
            max_position_embeddings=int(cfg.max_position_embeddings),
            num_experts=int(cfg.num_experts) if moe else 0,
            moe_ffn_hidden_size=int(cfg.moe_intermediate_size) if moe else 0,
            moe_topk=int(cfg.num_experts_per_tok) if moe else 0,
            norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", True)),
            router_aux_loss_coef=float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
            if moe else 0.0,
        )


# -- QKV and gate/up ---------------------------------------------------------------------------
def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, shape: ModelShape) -> Tensor:
    """HF q/k/v (weights `[out, in]` or biases `[out]`) -> megatron's grouped `linear_qkv`."""
    g, d = shape.num_kv_heads, shape.head_dim
    tail = q.shape[1:]
    parts = (
        q.reshape(g, shape.heads_per_group * d, *tail),
        k.reshape(g, d, *tail),
        v.reshape(g, d, *tail),
    )
    return torch.cat(parts, dim=1).reshape(-1, *tail)


def split_qkv(qkv: Tensor, shape: ModelShape) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv`."""
    g, d, hpg = shape.num_kv_heads, shape.head_dim, shape.heads_per_group
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (hpg + 2) * d, *tail)
    q, k, v = torch.split(grouped, [hpg * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


# -- full state dicts ----------------------------------------------------------------------
_SIMPLE_LAYER = {  # megatron suffix -> HF suffix, copied as is
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_DENSE_MLP = {"mlp.linear_fc2.weight": "mlp.down_proj.weight"}
_ROUTER = {"mlp.router.weight": "mlp.gate.weight"}
_QK_NORM = {  # qk_layernorm (Qwen3) only
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


def _simple_layer(shape: ModelShape) -> dict[str, str]:
    """Megatron suffix -> HF suffix of the layer tensors copied as they are."""
    return {**_SIMPLE_LAYER, **(_ROUTER if shape.is_moe else _DENSE_MLP),
            **(_QK_NORM if shape.qk_layernorm else {})}


def _hf_experts(hf: Mapping[str, Tensor], src: str, shape: ModelShape) -> tuple[Tensor, Tensor]:
    """One HF layer's experts as `([experts, 2 * ffn, hidden] gate_up, [experts, hidden, ffn]
    down)`, from the fused in-memory names or the per-expert names on disk."""
    fused = src + "mlp.experts.gate_up_proj"
    if fused in hf:
        return hf[fused], hf[src + "mlp.experts.down_proj"]
    e = src + "mlp.experts.{}."
    gate_up = torch.stack([
        torch.cat([hf[e.format(i) + "gate_proj.weight"], hf[e.format(i) + "up_proj.weight"]])
        for i in range(shape.num_experts)
    ])
    down = torch.stack([hf[e.format(i) + "down_proj.weight"] for i in range(shape.num_experts)])
    return gate_up, down


def expert_name(layer: int, expert: int, fc: str) -> str:
    """Megatron name of one expert's `linear_fc1` / `linear_fc2` weight (full numbering)."""
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{fc}.weight"


def hf_to_mcore(hf: Mapping[str, Tensor], shape: ModelShape) -> dict[str, Tensor]:
    """Full HF state dict -> full megatron `GPTModel` state dict (TP=1, PP=1)."""
    out: dict[str, Tensor] = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(shape.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for mc_name, hf_name in _simple_layer(shape).items():
            out[dst + mc_name] = hf[src + hf_name]
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], shape
        )
        if shape.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = fuse_qkv(
                hf[attn + "q_proj.bias"], hf[attn + "k_proj.bias"], hf[attn + "v_proj.bias"], shape
            )
        if shape.is_moe:
            gate_up, down = _hf_experts(hf, src, shape)
            for e in range(shape.num_experts):
                out[expert_name(i, e, "linear_fc1")] = gate_up[e]
                out[expert_name(i, e, "linear_fc2")] = down[e]
            continue
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]], dim=0
        )
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not shape.tie_word_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def mcore_to_hf(mc: Mapping[str, Tensor], shape: ModelShape) -> dict[str, Tensor]:
    """Inverse of `hf_to_mcore`; a tied model also gets `lm_head.weight` (= embeddings), as
    HF's own `state_dict()` reports it."""
    embed = mc["embedding.word_embeddings.weight"]
    out: dict[str, Tensor] = {"model.embed_tokens.weight": embed}
    for i in range(shape.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for mc_name, hf_name in _simple_layer(shape).items():
            out[dst + hf_name] = mc[src + mc_name]
        q, k, v = split_qkv(mc[src + "self_attention.linear_qkv.weight"], shape)
        out.update({dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k})
        out[dst + "self_attn.v_proj.weight"] = v
        if shape.qkv_bias:
            qb, kb, vb = split_qkv(mc[src + "self_attention.linear_qkv.bias"], shape)
            out.update({dst + "self_attn.q_proj.bias": qb, dst + "self_attn.k_proj.bias": kb})
            out[dst + "self_attn.v_proj.bias"] = vb
        if shape.is_moe:
            experts = range(shape.num_experts)
            out[dst + "mlp.experts.gate_up_proj"] = torch.stack(
                [mc[expert_name(i, e, "linear_fc1")] for e in experts])
            out[dst + "mlp.experts.down_proj"] = torch.stack(
                [mc[expert_name(i, e, "linear_fc2")] for e in experts])
            continue
        gate, up = torch.chunk(mc[src + "mlp.linear_fc1.weight"], 2, dim=0)
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = gate, up
    out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = embed if shape.tie_word_embeddings else mc["output_layer.weight"]
    return out


# -- tensor parallelism --------------------------------------------------------------------------
def tp_split_dim(name: str) -> int | None:
    """Split dim of a megatron parameter: 0 column-parallel, 1 row-parallel, None replicated."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight")):
        return 0
    if name.endswith(("output_layer.weight", "linear_fc1.weight")):
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def check_tp(shape: ModelShape, tp: int) -> None:
    """Clear errors for shapes that a TP degree cannot split evenly."""
    for what, n in (
        ("num_key_value_heads", shape.num_kv_heads),
        ("num_attention_heads", shape.num_heads),
        ("intermediate_size", shape.ffn_hidden_size),
        ("vocab_size", shape.vocab_size),
    ):
        if n % tp:
            raise ValueError(f"model config {what}={n} is not divisible by tensor parallel {tp}")
    if shape.is_moe and shape.moe_ffn_hidden_size % tp:
        raise ValueError(f"model config moe_intermediate_size={shape.moe_ffn_hidden_size} is "
                         f"not divisible by tensor parallel {tp}")


def check_ep(shape: ModelShape, ep: int) -> None:
    """Clear errors for an expert-parallel degree the model cannot use."""
    if ep == 1:
        return
    if not shape.is_moe:
        raise ValueError(f"train.expert_parallel={ep} needs an MoE model; this model is dense")
    if shape.num_experts % ep:
        raise ValueError(f"model config num_experts={shape.num_experts} is not divisible by "
                         f"train.expert_parallel={ep}")


def shard_tp(full: Mapping[str, Tensor], rank: int, size: int) -> dict[str, Tensor]:
    """This TP rank's slice of a full megatron state dict (any PP stage's subset)."""
    out = {}
    for name, t in full.items():
        dim = tp_split_dim(name)
        if dim is None or size == 1:
            out[name] = t
        elif name.endswith("linear_fc1.weight"):
            gate, up = torch.chunk(t, 2, dim=0)
            out[name] = torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]], dim=0)
        else:
            out[name] = t.chunk(size, dim=dim)[rank]
    return {k: v.contiguous() for k, v in out.items()}


def merge_tp(shards: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Inverse of `shard_tp`: the per-rank dicts of one PP stage, in TP-rank order."""
    return {name: merge_tp_tensor(name, [s[name] for s in shards]) for name in shards[0]}


def merge_tp_tensor(name: str, parts: Sequence[Tensor]) -> Tensor:
    """One parameter's TP shards, in TP-rank order, as the full tensor."""
    dim = tp_split_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):  # [gate; up] per rank -> [all gates; all ups]
        halves = [torch.chunk(p, 2, dim=0) for p in parts]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(list(parts), dim=dim)


# -- expert parallelism ------------------------------------------------------------------------
def shard_ep(full: Mapping[str, Tensor], rank: int, size: int, num_experts: int) -> dict[str, Tensor]:
    """EP rank `rank`'s part: every non-expert tensor, and experts
    `[rank * E / size, (rank + 1) * E / size)` renumbered from 0 (megatron's local experts)."""
    per = num_experts // size
    out: dict[str, Tensor] = {}
    for name, t in full.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        elif rank * per <= int(m.group(2)) < (rank + 1) * per:
            out[f"{m.group(1)}{int(m.group(2)) - rank * per}.{m.group(3)}"] = t
    return out


def expert_tensors(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The expert tensors of a (local) megatron state dict."""
    return {k: v for k, v in sd.items() if _EXPERT.match(k)}


def merge_ep(shards: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Inverse of `shard_ep`: the EP ranks' dicts in EP-rank order (non-expert tensors are
    taken from the first; the others may hold their experts only)."""
    out = {k: v for k, v in shards[0].items() if not _EXPERT.match(k)}
    for rank, shard in enumerate(shards):
        local = {int(m.group(2)) for k in shard if (m := _EXPERT.match(k))}
        per = len(local)
        for name, t in shard.items():
            m = _EXPERT.match(name)
            if m:
                out[f"{m.group(1)}{int(m.group(2)) + rank * per}.{m.group(3)}"] = t
    return out


# -- pipeline parallelism ------------------------------------------------------------------------
def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Global layer indices of one PP stage (even split, as megatron's default)."""
    if num_layers % pp_size:
        raise ValueError(f"num_hidden_layers={num_layers} is not divisible by pipeline {pp_size}")
    per = num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


def select_stage(
    full: Mapping[str, Tensor], layers: range, pre_process: bool, post_process: bool
) -> dict[str, Tensor]:
    """The parameters of one PP stage, layers renumbered from 0 as megatron stores them."""
    out = {}
    for name, t in full.items():
        m = _LAYER.match(name)
        if m:
            i = int(m.group(1))
            if i in layers:
                out[f"decoder.layers.{i - layers.start}.{m.group(2)}"] = t
        elif name.startswith("embedding."):
            if pre_process:
                out[name] = t
        elif post_process:
            out[name] = t
    return out


def merge_stages(stages: Sequence[tuple[int, Mapping[str, Tensor]]]) -> dict[str, Tensor]:
    """Inverse of `select_stage`: `(first global layer, stage dict)` pairs.

    A tied output layer that megatron also keeps on the last stage (`output_layer.weight`
    absent, or a copy of the embeddings) is dropped by `mcore_to_hf` anyway.
    """
    out: dict[str, Tensor] = {}
    for start, sd in stages:
        for name, t in sd.items():
            m = _LAYER.match(name)
            out[f"decoder.layers.{int(m.group(1)) + start}.{m.group(2)}" if m else name] = t
    return out


def hf_layer_index(name: str) -> int | None:
    """The layer index of an HF parameter name, or None for embeddings / head / norm."""
    m = _HF_LAYER.match(name)
    return int(m.group(1)) if m else None
