"""Build a megatron-core `GPTModel` for a Llama / Qwen2 / Qwen3 / Qwen3-MoE HF config, with no
TE and no apex.

The layer spec is megatron's *local* spec (plain `ColumnParallelLinear`/`RowParallelLinear`,
torch RMSNorm; for MoE a `TopKRouter` and a `SequentialMLP` of local experts, a loop over
plain linears, since grouped GEMM needs TE) with its core attention swapped for
`SDPACoreAttention`: the local
`DotProductAttention` materialises `[b, heads, s, s]` scores, while
`torch.nn.functional.scaled_dot_product_attention` runs flash / memory-efficient kernels.

Sequences are right-padded and attention is causal, so pad tokens at the end never reach a
real token and no padding mask is needed (same argument as `engines/train/batching.py`).
Packed micro-batches (`train.pack_sequences`) come as megatron's `thd` format: one row of
sequences end to end with `cu_seqlens` in `PackedSeqParams`; RoPE restarts in each sequence
(`rope.py`: one pass over all tokens, where megatron's own loops over the sequences), and
the core attention runs flash varlen attention (`varlen_causal_attention`).
Megatron is imported inside the functions: this module is safe to import without it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from engines.train.megatron.hf_convert import ModelShape


def _sdpa_attention_class() -> type:
    from megatron.core.transformer.module import MegatronModule

    class SDPACoreAttention(MegatronModule):
        """Drop-in for megatron's core attention: `[s, b, heads, d]` q/k/v -> `[s, b, h*d]`."""

        def __init__(
            self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
            attention_dropout: float | None = None, softmax_scale: float | None = None,
            **_: Any,
        ) -> None:
            super().__init__(config=config)
            self.softmax_scale = softmax_scale
            self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

        def forward(
            self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
            attn_mask_type: Any = None, attention_bias: Tensor | None = None,
            packed_seq_params: Any = None, **_: Any,
        ) -> Tensor:
            if attention_bias is not None:
                raise NotImplementedError("SDPACoreAttention: no attention bias")
            if packed_seq_params is not None:  # thd: [t, heads, d] -> [t, h*d]
                out = varlen_causal_attention(
                    query, key, value, packed_seq_params.cu_seqlens_q,
                    int(packed_seq_params.max_seqlen_q), self.softmax_scale,
                )
                return out.reshape(out.shape[0], -1)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, h, s, d]
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.softmax_scale,
                dropout_p=self.dropout if self.training else 0.0,
                enable_gqa=q.shape[1] != k.shape[1],
            )
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPACoreAttention


@functools.cache
def _flash_varlen() -> tuple[Any, frozenset[str]] | None:
    """torch's `varlen_attn` and the names of its parameters (they changed between torch
    releases), looked up once: attention runs per layer and micro-batch."""
    try:
        from torch.nn.attention import varlen
    except ImportError:
        return None
    fn = getattr(varlen, "varlen_attn", None)
    return None if fn is None else (fn, frozenset(inspect.signature(fn).parameters))


def varlen_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
    scale: float | None = None,
) -> Tensor:
    """Causal attention within each of the sequences laid end to end in `[t, heads, d]`
    q/k/v (`cu_seqlens`: int32 start offsets); k/v may have fewer heads (GQA).

    torch's flash varlen kernel (`torch.nn.attention.varlen`, torch >= 2.9) where it
    exists (bf16/fp16 on CUDA); else SDPA per sequence (the same result, a launch per
    sequence: float32 and CPU, which flash does not take)."""
    rep = q.shape[1] // k.shape[1]
    flash = _flash_varlen()
    if flash is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        varlen_attn, params = flash
        kw: dict[str, Any] = {"scale": scale} if "scale" in params else {}
        if "is_causal" in params:  # torch 2.9-2.10
            kw["is_causal"] = True
        else:  # later: a (left, right) window, (-1, 0) is causal
            kw["window_size"] = (-1, 0)
        if rep > 1 and "enable_gqa" in params:
            kw["enable_gqa"] = True
        elif rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        out = varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu,
                          max_seqlen, max_seqlen, **kw)
        return out[0] if isinstance(out, tuple) else out
    bounds = cu_seqlens.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, s, d]
        parts.append(F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=rep > 1
        ).transpose(0, 1))
    return torch.cat(parts, dim=0)


def layer_spec(sdpa: bool = True, qk_layernorm: bool = False, num_experts: int = 0) -> Any:
    """megatron's local GPT layer spec (RMSNorm; per-head q/k norms for Qwen3; an MoE MLP of
    `num_experts` sequential experts), optionally with SDPA core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=num_experts or None, moe_grouped_gemm=False, qk_layernorm=qk_layernorm,
        normalization="RMSNorm",
    )
    if sdpa:
        spec.submodules.self_attention.submodules.core_attention = _sdpa_attention_class()
    return spec


def moe_config(shape: ModelShape) -> dict[str, Any]:
    """`TransformerConfig` fields of an MoE model, routed as HF Qwen3-MoE routes: softmax over
    all experts, top-k, the k weights renormalised when `norm_topk_prob` (top-k of the logits
    then a softmax over those k is the same thing), else softmax first (`pre_softmax`).

    No load-balancing loss: megatron's differs from HF's (per layer rather than pooled over
    layers, a 1/top-k factor, pad tokens counted, and with `calculate_per_token_loss` summed
    over micro-batches and DP ranks), so the torch backend alone adds one
    (docs/models.md). Every router gets megatron's `RouterReplay`, which routes as usual
    until `replayed_routing` hands it ids."""
    if not shape.is_moe:
        return {}
    return dict(
        moe_enable_routing_replay=True,
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.moe_topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_pre_softmax=not shape.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
    )


def transformer_config(
    shape: ModelShape, tp: int, pp: int, dtype: torch.dtype, cpu_init: bool = False,
    ep: int = 1,
) -> Any:
    """A `TransformerConfig` matching HF Llama/Qwen2/Qwen3/Qwen3-MoE numerics (no fusions
    needing apex/TE; the swiglu fusion is megatron's own, through torch.compile).

    `calculate_per_token_loss=True` makes megatron *sum* (not average) gradients over DP
    ranks and micro-batches: our losses are already divided by the global step denominator.
    """
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=True,  # swiglu through megatron's torch.compile'd fusion (no TE)
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # allgather rejects varlen
        calculate_per_token_loss=True,
        use_cpu_initialization=cpu_init,
        **moe_config(shape),
    )


@contextlib.contextmanager
def replayed_routing(model: Any, routed: Tensor | None) -> Iterator[None]:
    """While open, each MoE router of `model` (this rank's stage; DDP-wrapped or not) sends
    the forward's tokens to the experts in `routed` (`[B, L, layers, topk]`, as
    `routing_replay.build_replay_batch` lays them out, all layers) with its own weights for
    them: megatron's `RouterReplay` in REPLAY_FORWARD, which gathers the router's scores at
    those ids (then the softmax over the k, or the renormalised softmax, as it routes itself).
    A router sees its `[L, B]` tokens sequence-first, so the ids go position-major. `routed`
    None replays nothing. The backward needs no ids (no activation recompute)."""
    if routed is None:
        yield
        return
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    replays = []
    for layer in getattr(model, "module", model).decoder.layers:
        replay = getattr(getattr(layer.mlp, "router", None), "router_replay", None)
        if replay is None:
            raise ValueError("algorithm.routing_replay needs an MoE model; this megatron "
                             "model's layers have no router")
        ids = routed[:, :, layer.layer_number - 1].transpose(0, 1).reshape(-1, routed.shape[-1])
        replay.set_target_indices(ids)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        replays.append(replay)
    try:
        yield
    finally:
        for replay in replays:
            replay.clear_indices()
            replay.clear_router_replay_action()


class ValueHead(torch.nn.Linear):
    """The critic's output layer in place of the vocab projection: hidden -> one value.

    Called as megatron calls its output layer, `(hidden [s, b, h], weight=..., ...) ->
    (values [s, b, 1], None)`. Replicated, not split, over TP ranks: its input (the final
    norm's output) is the same on every TP rank, and so are its gradients; megatron's
    checkpointing treats a plain module's tensors as replicated too."""

    def forward(self, hidden: Tensor, *_: Any, **__: Any) -> tuple[Tensor, None]:  # type: ignore[override]
        return super().forward(hidden), None


def build_gpt_model(
    shape: ModelShape, config: Any, sdpa: bool = True, value_head: bool = False,
    seed: int = 0,
) -> Any:
    """This rank's `GPTModel` (its PP stage, its TP shard), on the current CUDA device, every
    parameter in `config.params_dtype` (without apex/TE megatron's norms would stay float32,
    and mixed dtypes break the distributed optimizer's checkpoint layout). `value_head`: a
    critic, whose last stage ends in a `ValueHead` initialised from `seed` (see critic.py)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from engines.train.critic import init_value_head
    from engines.train.megatron import rope

    rope.install()  # packed micro-batches' RoPE without a per-sequence loop
    post = ps.is_pipeline_last_stage()
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(sdpa, shape.qk_layernorm, shape.num_experts),
        vocab_size=shape.vocab_size,
        max_sequence_length=shape.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=shape.tie_word_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta),
    )
    if value_head and post:
        head = ValueHead(shape.hidden_size, 1)
        init_value_head(head, shape.hidden_size, seed)
        model.output_layer = head
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(device=torch.cuda.current_device(), dtype=config.params_dtype)
    return model
