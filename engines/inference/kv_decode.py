"""One decode step of the embedded engine: a lean forward over a growable KV cache (`kv_cache`).

Profiled at batch 64 on the example model, HF's per-step forward spent most of its time on
bookkeeping rather than matmuls: `DynamicCache` re-concatenates every layer's keys and
values each step (O(length) copies per token), a 4-D mask is rebuilt from the 2-D one, and
each of the ~40 modules per layer goes through `nn.Module.__call__`. On a CPU every aten op
also costs a few microseconds of dispatch whatever its size, which at this model size is
as much as the matmuls. `KVCache` (`kv_cache`) keeps each layer's keys and values in one preallocated
buffer that grows by chunks (one column written per step, keys and values with one copy),
and `LlamaDecoder` runs the step in ~140 aten calls on the example model (views included;
HF's forward makes ~250) on weights it gathers once (fused q|k|v and gate|up, transposed
o/down) and regathers only when a parameter changes. It does the same arithmetic as HF's
Llama (in place where HF allocates; attention as two batched matmuls where HF calls SDPA,
whose CPU kernel is built for long queries), so greedy tokens equal HF's and log-probs
stay within 1e-5 of a full forward; models it does not cover fall back to `HFDecoder`, the
HF forward over views of the same buffers. For float32 on CPU without biases (HF's Llama
default) `LlamaDecoder` hands the whole step to one compiled call (`fused_decode`), which
does the same arithmetic with the ~140 dispatches between its matmuls gone.

Batch-invariant (`row_invariant`, engine.batch_invariant): a matmul's rows are not
independent in float32, MKL picks its kernels and blocking by the batch's shape, so a
request's log-probs moved by up to ~1e-5 with the requests beside it. The compiled step then
runs every reduction in one fixed order per row instead, and `prefill` feeds a prompt through
that same step a token at a time: a token's keys, values and logits are the same numbers
whatever shares its batch, and whether it was decoded or re-prefilled (a resumed partial
rollout). The cost is in bench/RESULTS.md ("Deterministic mode").
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from engines.inference import fused_decode, triton_decode
from engines.inference.fp8 import fp8_linear
from engines.inference.kv_cache import KVCache, RowFinish
from engines.inference.sampling import SamplingRows

log = logging.getLogger(__name__)
# the compiled step's per-layer weights, per-layer scalars and transposed lm_head
_FusedWeights = tuple[list[torch.Tensor], list[float], torch.Tensor]
TRITON_SWITCH = "ROLLFLOW_TRITON_DECODE"  # "0": the captured GPU step without Triton kernels


def _panels(weight_t: torch.Tensor, width: int = 64) -> torch.Tensor:
    """A transposed weight [in, out] as the compiled step's row-invariant chains read it:
    panels of `width` outputs, `[ceil(out / width), in, width]`, zeros past `out`, so that
    every load is a whole register (no mask in the chains' loop: see `chain_tile` in
    csrc/fused_decode.cpp) and a panel is one run of memory, read front to back."""
    rows, out = weight_t.shape
    blocks = -(-out // width)
    padded = weight_t.new_zeros(rows, blocks * width)
    padded[:, :out] = weight_t
    return padded.view(rows, blocks, width).transpose(0, 1).contiguous()


class Decoder(Protocol):
    """Decode one token per row: write its keys/values at column `cache.width`, advance the
    width, return the next-token logits `[rows, vocab]`."""

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache
    ) -> torch.Tensor: ...


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm op for op (float32 statistics, scale in the model dtype), with
    in-place steps where HF allocates and no dtype round trip for a float32 model."""
    if x.dtype != torch.float32:
        h = x.float()
        h = h * h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        return h.to(x.dtype).mul_(weight)
    return (x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(weight)


def _decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per row, `q` `[rows, heads, 1, d]` over `keys`/`values`
    `[rows, kv_heads, length, d]`, as two batched matmuls around a softmax. SDPA's CPU kernel
    (flash attention, built for long queries) took a third of a decode step at batch 64 for
    about 1M multiply-adds (bench/RESULTS.md, "Embedded engine vs HF generate"). The q heads that share a kv head (HF's
    `repeat_kv`: kv head i serves q heads i*g .. i*g+g-1) are one matrix of g rows."""
    rows, heads, _, d = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(rows, kv_heads, heads // kv_heads, d)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).mul_(scale)
    if bias is not None:
        scores.add_(bias)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values)  # [rows, kv_heads, g, d]: the heads in order


def _cat_params(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if len(present) == len(tensors) else None


@dataclass(frozen=True, slots=True)
class _Layer:
    """One layer's weights as the step uses them: q|k|v and gate|up concatenated (one
    matmul each), o and down as transposed views (their residual adds fold into `addmm`)."""

    norm1: torch.Tensor
    eps1: float
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_t: torch.Tensor
    scaling: float
    norm2: torch.Tensor
    eps2: float
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_t: torch.Tensor
    # Qwen3: each head's queries and keys are RMS-normalised before RoPE (None for Llama)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_eps: float = 0.0
    # engine.dtype fp8 (`fp8.py`): the projections' float8 weights have per-row scales
    qkv_scale: torch.Tensor | None = None
    o_scale: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None

    @classmethod
    def of(cls, layer: Any) -> _Layer:
        a, m = layer.self_attn, layer.mlp
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        return cls(
            n1.weight, n1.variance_epsilon,
            torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            _cat_params(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
            a.o_proj.weight.t(), a.scaling,
            n2.weight, n2.variance_epsilon,
            torch.cat([m.gate_proj.weight, m.up_proj.weight]),
            _cat_params(m.gate_proj.bias, m.up_proj.bias),
            m.down_proj.weight.t(),
            None if qn is None else qn.weight, None if kn is None else kn.weight,
            0.0 if qn is None else qn.variance_epsilon,
            _cat_params(*(_scale(p) for p in (a.q_proj, a.k_proj, a.v_proj))),
            _scale(a.o_proj), _cat_params(_scale(m.gate_proj), _scale(m.up_proj)),
            _scale(m.down_proj),
        )  # fmt: skip


def _scale(projection: Any) -> torch.Tensor | None:
    """A float8 projection's per-row weight scales (`fp8.Fp8Linear`), else None."""
    return getattr(projection, "weight_scale", None)


def _linear(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
) -> torch.Tensor:
    """`h @ weight.T + bias`, through the float8 matmul where `weight` has `scale`s."""
    if scale is None:
        return F.linear(h, weight, bias)
    return fp8_linear(h, weight, scale, bias)


def _add_projection(
    x: torch.Tensor, h: torch.Tensor, weight_t: torch.Tensor, scale: torch.Tensor | None,
) -> torch.Tensor:
    """The residual `x` plus `h @ weight_t` (`weight_t` a transposed view of the weight)."""
    if scale is None:
        return torch.addmm(x, h, weight_t)
    return x + fp8_linear(h, weight_t.t(), scale)


class LlamaDecoder:
    """The Llama decode step as tensor ops on the model's parameters (see the module doc).

    Fewer, larger ops per layer than HF's modules (q|k|v and gate|up fused, RoPE applied to
    q and k at once and in place, keys and values stored with one copy, the padding mask
    turned into an additive bias once per step instead of once per layer, residual adds
    folded into `addmm`): on a CPU each op is a dispatch and often a thread-pool round trip.
    The weights it uses are regathered whenever a parameter changes (in-place copy or
    swapped storage, seen through its version counter and data pointer), so weight updates
    and memory release need no hook.
    """

    def __init__(self, model: Any, use_fused: bool = True, row_invariant: bool = False) -> None:
        config = model.config
        self.model = model
        self.row_invariant = row_invariant
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self._params = list(model.parameters())
        self._key: list[tuple[int, int]] = []
        self._layers: list[_Layer] = []
        self._rope_table = torch.zeros(0)
        self._zero = self._neg_inf = torch.zeros(0)
        self._head: tuple[Any, ...] = ()  # embedding, final norm weight and eps, lm_head
        weight = model.get_input_embeddings().weight
        on_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32
        self._fused = fused_decode.load() if use_fused and on_cpu else None  # no build for GPUs
        self._fused_weights: _FusedWeights | None = None
        self._layer_fn: Callable[..., torch.Tensor] = _decode_layer
        # a captured step on a GPU runs `triton_decode`'s kernels (ROLLFLOW_TRITON_DECODE=0:
        # the eager ops, as a graph of them; torch.compile's layers use them too)
        self.triton = (
            weight.device.type == "cuda" and os.environ.get(TRITON_SWITCH, "1") != "0"
            and triton_decode.available()
            and triton_decode.supports(self.head_dim, self.heads // self.kv_heads)
        )  # fmt: skip

    @staticmethod
    def supports(model: Any) -> bool:
        """Llama layouts with a static RoPE (the table is position-only) and full attention:
        Llama, Qwen2 (Llama plus q/k/v biases) and dense Qwen3 (Llama plus per-head q/k
        norms), without sliding windows."""
        config = model.config
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
        inner = getattr(model, "model", None)
        model_type = getattr(config, "model_type", None)
        return (
            (model_type == "llama"
             or (model_type in ("qwen2", "qwen3")
                 and not getattr(config, "use_sliding_window", False)))
            and getattr(config, "hidden_act", None) == "silu"
            and rope_type not in ("dynamic", "longrope")
            and getattr(config, "_attn_implementation", "sdpa") in ("sdpa", "eager")
            and inner is not None
            and hasattr(inner, "rotary_emb")
            and hasattr(model, "lm_head")
            and getattr(inner.layers[0].mlp.down_proj, "bias", None) is None
            and getattr(inner.layers[0].self_attn.o_proj, "bias", None) is None
        )

    def _weights(self) -> list[_Layer]:
        key = [(p.data_ptr(), p._version) for p in self._params]
        if key != self._key:
            inner, lm_head = self.model.model, self.model.lm_head
            self._layers = [_Layer.of(layer) for layer in inner.layers]
            weight = inner.embed_tokens.weight
            self._head = (
                weight, inner.norm.weight, inner.norm.variance_epsilon, lm_head.weight,
                lm_head.bias,
            )  # fmt: skip
            self._zero = weight.new_zeros(())
            self._neg_inf = weight.new_full((), float("-inf"))
            self._fused_weights = self._flatten_for_fused()
            self._key = key
        return self._layers

    def _flatten_for_fused(self) -> _FusedWeights | None:
        """The compiled step's weights and per-layer scalars, or None where it does not
        apply: it covers float32 on CPU without biases or q/k norms (HF's Llama default).
        Each projection goes as its weight transposed, [in, out]: a view for MKL's matmuls,
        a contiguous copy for the row-invariant chains, whose lanes run along the outputs."""
        weight, _, _, lm_head, lm_bias = self._head
        layers = self._layers
        if (self._fused is None or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or lm_bias is not None
                or any(w.qkv_bias is not None or w.gate_up_bias is not None
                       or w.q_norm is not None for w in layers)):
            return None

        def t(w: torch.Tensor) -> torch.Tensor:
            return _panels(w) if self.row_invariant else w

        weights = [m for w in layers
                   for m in (w.norm1, t(w.qkv.t()), t(w.o_t), w.norm2, t(w.gate_up.t()),
                             t(w.down_t))]
        scalars = [float(v) for w in layers for v in (w.eps1, w.eps2, w.scaling)]
        head = lm_head.t().contiguous() if self.row_invariant else lm_head.t()
        return weights, scalars, head

    @property
    def parallel_rows(self) -> int | None:
        """The fewest rows for which the compiled step is worth a second thread (it gives
        each thread at least 8 rows); None while the Python step runs."""
        return 2 * fused_decode.MIN_BLOCK_ROWS if self._fused_weights is not None else None

    def _fused_step(
        self, fused: _FusedWeights, tokens: torch.Tensor,
        positions: torch.Tensor, cache: KVCache,
    ) -> torch.Tensor:
        assert self._fused is not None  # (weights are flattened only when it is there)
        col = cache.width
        cache.mask[:, col] = True
        logits: torch.Tensor = self._fused.decode_step(
            *self._compiled_args(fused, tokens, positions, cache, 1))
        cache.width = col + 1
        return logits

    def _compiled_args(
        self, fused: _FusedWeights, tokens: torch.Tensor,
        positions: torch.Tensor, cache: KVCache, steps: int,
    ) -> tuple[Any, ...]:
        """What `decode_step` takes, and `decode_steps` first, for steps from column
        `cache.width` on (the RoPE table covers `steps` more positions)."""
        col = cache.width
        embed, norm, eps, _, _ = self._head
        weights, scalars, lm_head_t = fused
        return (
            tokens.long().contiguous(), positions.long().contiguous(), weights, scalars,
            cache.layers, cache.mask, cache.padded, self._rope_rows(col + steps - 1), embed, norm,
            float(eps), lm_head_t, self.heads, self.kv_heads, col, fused_decode.MIN_BLOCK_ROWS,
            self.row_invariant,
        )  # fmt: skip

    def decode_steps(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, steps: int,
        sampling: SamplingRows, uniforms: torch.Tensor | None, finish: RowFinish,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Up to `steps` tokens per row in one compiled call, each step's sample fed to the
        next (`[steps taken, rows]` tokens and log-probs); it stops after a step at which a
        live row finishes. None where the compiled step does not run: then one step at a
        time. The cache advances by the steps taken; `positions` are the caller's to move."""
        self._weights()
        fused = self._fused_weights
        if fused is None or sampling.truncates:
            return None
        assert self._fused is not None
        cache.reserve(steps)
        col = cache.width
        out: tuple[torch.Tensor, torch.Tensor] = self._fused.decode_steps(
            *self._compiled_args(fused, tokens, positions, cache, steps), steps,
            sampling.divisor, uniforms, sampling.greedy, finish.live, finish.left,
            finish.stop_ids,
        )  # fmt: skip
        cache.width = col + out[0].shape[0]
        return out

    @property
    def batch_invariant(self) -> bool:
        """Whether steps and `prefill` give each row numbers of its own alone (the compiled
        step in row-invariant mode applies to this model)."""
        self._weights()
        return self.row_invariant and self._fused_weights is not None

    def prefill(
        self, ids: torch.Tensor, attn: torch.Tensor, room: int
    ) -> tuple[KVCache, torch.Tensor]:
        """Row-invariant prefill of left-padded prompts `ids` (mask `attn`): one compiled
        step per column, so each real token is computed as a decode step computes it.
        Returns the cache (`room` free columns) and the last column's logits. A padding
        column is written but masked: no real token ever reads it."""
        self._weights()
        fused = self._fused_weights
        assert fused is not None and self._fused is not None  # (batch_invariant checked)
        rows, width = ids.shape
        like = self.model.model.embed_tokens.weight
        layers = [like.new_zeros(rows, self.kv_heads, 2, width + room, self.head_dim)
                  for _ in self._layers]
        real = attn.bool()
        cache = KVCache(layers, real.new_zeros(rows, width + room), 0)
        positions = (attn.cumsum(-1) - 1).clamp_(min=0)
        logits = torch.empty(0)
        for col in range(width):
            cache.mask[:, col] = real[:, col]
            cache.padded = not bool(real[:, : col + 1].all())
            logits = self._fused.decode_step(
                *self._compiled_args(fused, ids[:, col], positions[:, col], cache, 1))
            cache.width = col + 1
        cache._check_padding()
        return cache, logits

    def _rope_rows(self, width: int) -> torch.Tensor:
        """cos and sign-folded sin of positions up to `width`, `[size, 2, head_dim]`
        (`rotate_half(x) * sin` becomes `roll(x, head_dim / 2) * sin`), made by the model's
        own rotary module, so any static scaling applies."""
        weight = self.model.model.embed_tokens.weight
        table = self._rope_table
        if table.shape[0] <= width or table.dtype != weight.dtype or table.device != weight.device:
            size = max(256, 2 * (width + 1))
            probe = torch.zeros(1, dtype=weight.dtype, device=weight.device)
            pos = torch.arange(size, device=weight.device)[None]
            cos, sin = self.model.model.rotary_emb(probe, pos)
            half = sin.shape[-1] // 2
            sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)
            self._rope_table = table = torch.stack([cos[0], sin], 1).contiguous()
        return table

    def _rope(self, positions: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin `[rows, 1, 1, head_dim]`; positions are at most `width`."""
        cos, sin = self._rope_rows(width)[positions].unbind(1)
        return cos[:, None, None], sin[:, None, None]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        self._weights()
        cache.reserve(1)
        if self._fused_weights is not None:
            return self._fused_step(self._fused_weights, tokens, positions, cache)
        col = cache.width
        cos, sin = self._rope(positions, col)
        cache.mask[:, col] = True
        bias = None  # the padding mask as an additive bias, once per step (not per layer)
        if cache.padded:
            bias = torch.where(cache.mask[:, None, None, : col + 1], self._zero, self._neg_inf)
        logits = self._forward(tokens, cos, sin, bias, cache.layers, col)
        cache.width = col + 1
        return logits

    def step_at(
        self, tokens: torch.Tensor, positions: torch.Tensor, col: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """`__call__` with the column a 1-element device tensor, and no host sync or
        Python-side state: what a CUDA graph captures once and replays at every column
        (`cuda_graph_decode`). Attention reads every column of the cache, the unwritten
        ones masked (through `triton_decode`'s kernels, on a GPU: the written ones only);
        the caller advances `col` and `cache.width`. Weights (`_weights`) and
        the RoPE table (`rope_table`) must be current before a capture."""
        cache.mask.index_fill_(1, col, True)
        if self.triton:
            return self._triton_forward(tokens, positions, col, cache)
        cos, sin = self._rope_table[positions].unbind(1)
        bias = torch.where(cache.mask[:, None, None, :], self._zero, self._neg_inf)
        return self._forward(tokens, cos[:, None, None], sin[:, None, None], bias,
                             cache.layers, col)

    def _triton_forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, col: torch.Tensor, cache: KVCache,
    ) -> torch.Tensor:
        """`_forward` for `step_at` on a GPU through `triton_decode`'s kernels: eight a layer
        instead of ~33, attention over the written columns only."""
        embed, norm, eps, lm_head, lm_bias = self._head
        x = F.embedding(tokens, embed)
        for w, kv in zip(self._layers, cache.layers, strict=True):
            x = _triton_layer(x, kv, cache.mask, col, positions, self._rope_table, w,
                              self.heads, self.kv_heads)
        return F.linear(triton_decode.rms_norm(x, norm, eps), lm_head, lm_bias)

    def rope_table(self, width: int) -> torch.Tensor:
        """The RoPE table `step_at` reads, covering positions up to `width` (a graph
        captured over it must keep it alive: a longer table is a new tensor)."""
        return self._rope_rows(width)

    @property
    def weights_key(self) -> list[tuple[int, int]]:
        """Changes whenever the gathered weights are rebuilt (a captured graph reads them)."""
        self._weights()
        return self._key

    def _forward(
        self, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        bias: torch.Tensor | None, kv_layers: list[torch.Tensor], col: int | torch.Tensor,
    ) -> torch.Tensor:
        """The layers and head for one token per row, storing its keys and values at `col`:
        an int (attention reads columns up to it) or a 1-element device tensor (it reads
        every column; `bias` masks those not written yet)."""
        embed, norm, eps, lm_head, lm_bias = self._head
        x = F.embedding(tokens, embed)
        layer = self._layer_fn
        for w, kv in zip(self._layers, kv_layers, strict=True):
            x = layer(x, kv, cos, sin, bias, col, w.norm1, w.qkv, w.qkv_bias, w.o_t, w.norm2,
                      w.gate_up, w.gate_up_bias, w.down_t, w.q_norm, w.k_norm, w.eps1, w.eps2,
                      w.qk_eps, w.scaling, self.heads, self.kv_heads, w.qkv_scale, w.o_scale,
                      w.gate_up_scale, w.down_scale)  # fmt: skip
        return F.linear(_rms_norm(x, norm, eps), lm_head, lm_bias)

    def compile_layers(self) -> None:
        """Run each layer through `torch.compile` (one compiled function for all layers and
        all decoders of the process, dynamic in rows and cache columns): its ~30 small
        kernels a layer fuse into a few, on a GPU where a step is launch- and memory-bound
        (`cuda_graph_decode`). A failed compile warns and keeps the eager layer."""
        compiled = _compiled_layer()
        self.triton = False  # (the compiled layers are the eager ops, fused by Inductor)

        def layer(*args: Any) -> torch.Tensor:
            if self._layer_fn is layer:
                try:
                    return compiled(*args)
                except Exception as err:  # noqa: BLE001 - any compiler failure: stay eager
                    log.warning("decode step: torch.compile failed (%r); eager layers", err)
                    self._layer_fn = _decode_layer
            return _decode_layer(*args)

        self._layer_fn = layer


@functools.cache
def _compiled_layer() -> Callable[..., torch.Tensor]:
    """`_decode_layer` through torch.compile, made once: a decoder rebuilt after a memory
    release (every colocated step) reuses its compiled code."""
    from torch.fx.experimental import _config as shapes

    compiled = torch.compile(_decode_layer, dynamic=True)

    def general(*args: Any) -> torch.Tensor:
        # rows and cache columns are not tied to another size they happen to equal (duck
        # shapes: each coincidence, as rows shrink while requests end, cost a recompile);
        # one row is still a compile of its own
        with shapes.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            return compiled(*args)

    return general


def _decode_layer(
    x: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    bias: torch.Tensor | None, col: int | torch.Tensor, norm1: torch.Tensor, qkv_w: torch.Tensor,
    qkv_b: torch.Tensor | None, o_t: torch.Tensor, norm2: torch.Tensor, gate_up: torch.Tensor,
    gate_up_b: torch.Tensor | None, down_t: torch.Tensor, q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None, eps1: float, eps2: float, qk_eps: float, scaling: float,
    heads: int, kv_heads: int, qkv_s: torch.Tensor | None = None,
    o_s: torch.Tensor | None = None, gate_up_s: torch.Tensor | None = None,
    down_s: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer for one token per row (`_Layer`'s weights), storing its keys and values
    at `col` of `kv`: an int (attention reads columns up to it) or a 1-element device tensor
    (it reads every column; `bias` masks those not written yet). Plain tensor arguments, so
    that `torch.compile` takes it whole."""
    rows, d = x.shape[0], kv.shape[-1]
    qk = heads + kv_heads
    h = _rms_norm(x, norm1, eps1)
    qkv = _linear(h, qkv_w, qkv_b, qkv_s).view(rows, -1, 1, d)  # heads q | k | v
    q_k = qkv[:, :qk]
    if q_norm is not None and k_norm is not None:  # Qwen3, before RoPE
        q_k[:, :heads] = _rms_norm(q_k[:, :heads], q_norm, qk_eps)
        q_k[:, heads:] = _rms_norm(q_k[:, heads:], k_norm, qk_eps)
    rot = q_k.roll(d // 2, -1)
    q_k.copy_(torch.addcmul(q_k * cos, rot, sin))  # RoPE on q and k heads (no `out=`: compiles)
    new = qkv[:, heads:].view(rows, 2, kv_heads, d).transpose(1, 2)
    if isinstance(col, int):
        kv.select(3, col).copy_(new)
        keys, values = kv.narrow(3, 0, col + 1).unbind(2)
    else:
        kv.index_copy_(3, col, new.unsqueeze(3))
        keys, values = kv.unbind(2)
    out = _decode_attention(qkv[:, :heads], keys, values, bias, scaling)
    x = _add_projection(x, out.view(rows, -1), o_t, o_s)
    h = _rms_norm(x, norm2, eps2)
    gate, up = _linear(h, gate_up, gate_up_b, gate_up_s).chunk(2, dim=-1)
    return _add_projection(x, F.silu(gate, inplace=True).mul_(up), down_t, down_s)


def _triton_layer(
    x: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, col: torch.Tensor,
    positions: torch.Tensor, rope: torch.Tensor, w: _Layer, heads: int, kv_heads: int,
) -> torch.Tensor:
    """`_decode_layer` at a device-tensor column through `triton_decode`'s kernels: RMSNorm,
    SiLU times up and attention (with RoPE and the cache store) one kernel each."""
    h = triton_decode.rms_norm(x, w.norm1, w.eps1)
    qkv = _linear(h, w.qkv, w.qkv_bias, w.qkv_scale)
    if w.q_norm is not None and w.k_norm is not None:  # Qwen3, before RoPE
        per_head = qkv.view(x.shape[0], -1, kv.shape[-1])
        per_head[:, :heads] = _rms_norm(per_head[:, :heads], w.q_norm, w.qk_eps)
        per_head[:, heads : heads + kv_heads] = _rms_norm(
            per_head[:, heads : heads + kv_heads], w.k_norm, w.qk_eps)
    out = triton_decode.attention(qkv, kv, mask, col, positions, rope, heads, kv_heads,
                                  w.scaling)
    x = _add_projection_(x, out, w.o_t, w.o_scale)
    h = triton_decode.rms_norm(x, w.norm2, w.eps2)
    up = triton_decode.silu_mul(_linear(h, w.gate_up, w.gate_up_bias, w.gate_up_scale))
    return _add_projection_(x, up, w.down_t, w.down_scale)


def _add_projection_(
    x: torch.Tensor, h: torch.Tensor, weight_t: torch.Tensor, scale: torch.Tensor | None,
) -> torch.Tensor:
    """`_add_projection` into `x` itself: out-of-place `addmm` copied the residual into its
    output first, two device copies a layer (the step's own `x` is free to overwrite)."""
    if scale is None:
        return x.addmm_(h, weight_t)
    return x.add_(fp8_linear(h, weight_t.t(), scale))


class HFDecoder:
    """Any HF causal LM: its own forward over a `DynamicCache` of views into the buffers."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.reserve(1)
        col = cache.width
        dynamic = DynamicCache()
        for i, kv in enumerate(cache.layers):
            dynamic.update(kv[:, :, 0, :col], kv[:, :, 1, :col], i)
        cache.mask[:, col] = True
        out = self.model(
            input_ids=tokens[:, None], attention_mask=cache.mask[:, : col + 1].long(),
            position_ids=positions[:, None], past_key_values=dynamic, use_cache=True,
        )  # fmt: skip
        for layer, kv in zip(list[Any](dynamic.layers), cache.layers, strict=True):
            kv[:, :, 0, col] = layer.keys[:, :, -1]
            kv[:, :, 1, col] = layer.values[:, :, -1]
        cache.width = col + 1
        return out.logits[:, -1, :]


def make_decoder(model: Any, row_invariant: bool = False) -> Decoder:
    if LlamaDecoder.supports(model):
        return LlamaDecoder(model, row_invariant=row_invariant)
    return HFDecoder(model)
