"""One decode step of the embedded engine: a growable KV cache and a lean forward over it.

Profiled at batch 64 on the example model, HF's per-step forward spent most of its time on
bookkeeping rather than matmuls: `DynamicCache` re-concatenates every layer's keys and
values each step (O(length) copies per token), a 4-D mask is rebuilt from the 2-D one, and
each of the ~40 modules per layer goes through `nn.Module.__call__`. `KVCache` keeps keys and
values in preallocated buffers that grow by chunks (one column written per step), and
`LlamaDecoder` runs the step as plain tensor ops on the model's own parameters (read at call
time, so weight updates and memory release need no hook). It does the same ops in the same
order as HF's Llama with SDPA, so logits match HF's cached decode bit for bit here; models
it does not cover fall back to `HFDecoder`, the HF forward over views of the same buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

_CHUNK = 64  # columns added when a cache fills up (plus half its size, for amortized growth)


def _buffer(like: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
    return like.new_zeros(rows, like.shape[1], capacity, like.shape[3])


@dataclass(slots=True)
class KVCache:
    """Left-padded keys and values, `[rows, kv_heads, capacity, head_dim]` per layer.

    Columns `[0, width)` hold tokens; `mask[:, :width]` marks which are real (not padding).
    Every row appends at column `width`, so a step writes one column in place.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor  # bool [rows, capacity]
    width: int

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    @classmethod
    def from_prefill(cls, cache: DynamicCache, attn: torch.Tensor, room: int) -> KVCache:
        """Copy a prefill's `DynamicCache` (mask `attn`) into buffers with `room` free columns."""
        layers: list[Any] = list(cache.layers)
        rows, width = attn.shape
        kv = cls([], [], attn.new_zeros(rows, width + room, dtype=torch.bool), width)
        kv.mask[:, :width] = attn.bool()
        for layer in layers:
            for buffers, x in ((kv.keys, layer.keys), (kv.values, layer.values)):
                buffers.append(_buffer(x, rows, width + room))
                buffers[-1][:, :, :width] = x
        return kv

    def reserve(self, columns: int) -> None:
        """Make room for `columns` more tokens (copying into larger buffers if needed)."""
        need = self.width + columns
        if need > self.capacity:
            self._resize(torch.arange(self.mask.shape[0]), 0, need + max(_CHUNK, need // 2))

    def select(self, rows: torch.Tensor, trim: int, room: int) -> KVCache:
        """Rows `rows` without the first `trim` columns, with `room` free columns."""
        out = KVCache(list(self.keys), list(self.values), self.mask, self.width)
        out._resize(rows, trim, self.width - trim + room)
        return out

    def _resize(self, rows: torch.Tensor, trim: int, capacity: int) -> None:
        width = self.width - trim
        mask = self.mask.new_zeros(len(rows), capacity)
        mask[:, :width] = self.mask[rows, trim : self.width]
        for buffers in (self.keys, self.values):
            for i, x in enumerate(buffers):
                buffers[i] = _buffer(x, len(rows), capacity)
                buffers[i][:, :, :width] = x[rows, :, trim : self.width]
        self.mask, self.width = mask, width

    @staticmethod
    def concat(a: KVCache, b: KVCache, room: int) -> KVCache:
        """Rows of `a` then `b`, right-aligned to the wider of the two (left padding)."""
        width = max(a.width, b.width)
        rows = a.mask.shape[0] + b.mask.shape[0]
        out = KVCache([], [], a.mask.new_zeros(rows, width + room), width)
        starts = ((0, a), (a.mask.shape[0], b))
        for start, src in starts:
            out.mask[start : start + src.mask.shape[0], width - src.width : width] = src.mask[
                :, : src.width
            ]
        for name in ("keys", "values"):
            for xa, xb in zip(getattr(a, name), getattr(b, name), strict=True):
                buf = _buffer(xa, rows, width + room)
                for (start, src), x in zip(starts, (xa, xb), strict=True):
                    n = src.mask.shape[0]
                    buf[start : start + n, :, width - src.width : width] = x[:, :, : src.width]
                getattr(out, name).append(buf)
        return out


class Decoder(Protocol):
    """Decode one token per row: write its keys/values at column `cache.width`, advance the
    width, return the next-token logits `[rows, vocab]`."""

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache
    ) -> torch.Tensor: ...


def _rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    if x.dtype != torch.float32:  # HF normalizes in float32, then scales in the model dtype
        h = F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon)
        return norm.weight * h.to(x.dtype)
    return F.rms_norm(x, x.shape[-1:], norm.weight, norm.variance_epsilon)


def _cat_params(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if len(present) == len(tensors) else None


@dataclass(slots=True)
class _Fused:
    """One layer's projections concatenated: q|k|v and gate|up are one matmul each."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None


class LlamaDecoder:
    """The Llama decode step as tensor ops on the model's parameters (see the module doc).

    Fewer, larger ops per layer than HF's modules (q|k|v and gate|up fused, RoPE applied to
    q and k at once, residual adds folded into `addmm`): on a 2-core box each op is also a
    thread-pool round trip. Fused weights are rebuilt whenever a source parameter changes
    (in-place copy or swapped storage), so weight updates need no hook.
    """

    def __init__(self, model: Any) -> None:
        config = model.config
        self.model = model
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self._cos = self._sin = torch.zeros(0)
        self._fused: list[_Fused] = []
        self._fused_key: list[tuple[int, int]] = []

    def _sources(self) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for layer in self.model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
                out += [proj.weight] + ([proj.bias] if proj.bias is not None else [])
        return out

    def _layers(self) -> list[_Fused]:
        key = [(t.data_ptr(), t._version) for t in self._sources()]
        if key != self._fused_key:
            self._fused = []
            for layer in self.model.model.layers:
                a, m = layer.self_attn, layer.mlp
                self._fused.append(_Fused(
                    torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                    _cat_params(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]),
                    _cat_params(m.gate_proj.bias, m.up_proj.bias),
                ))  # fmt: skip
            self._fused_key = key
        return self._fused

    @staticmethod
    def supports(model: Any) -> bool:
        """Llama layouts with a static RoPE (the table is position-only) and full attention."""
        config = model.config
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
        rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
        inner = getattr(model, "model", None)
        return (
            getattr(config, "model_type", None) == "llama"
            and getattr(config, "hidden_act", None) == "silu"
            and rope_type not in ("dynamic", "longrope")
            and getattr(config, "_attn_implementation", "sdpa") in ("sdpa", "eager")
            and inner is not None
            and hasattr(inner, "rotary_emb")
            and hasattr(model, "lm_head")
            and getattr(inner.layers[0].mlp.down_proj, "bias", None) is None
            and getattr(inner.layers[0].self_attn.o_proj, "bias", None) is None
        )

    def _rope(self, positions: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sign-folded sin `[rows, 1, head_dim]` (`rotate_half(x) * sin` becomes
        `halves_swapped(x) * sin`) from a table made by the model's own rotary module, so any
        static scaling applies; positions are at most `width`."""
        weight = self.model.model.embed_tokens.weight
        if self._cos.shape[0] <= width or self._cos.dtype != weight.dtype:
            size = max(256, 2 * (width + 1))
            probe = torch.zeros(1, dtype=weight.dtype, device=weight.device)
            cos, sin = self.model.model.rotary_emb(probe, torch.arange(size)[None].to(probe.device))
            half = sin.shape[-1] // 2
            self._cos, self._sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.reserve(1)
        rows, col, d = tokens.shape[0], cache.width, self.head_dim
        qk = self.heads + self.kv_heads
        inner = self.model.model
        cos, sin = self._rope(positions, col)
        cache.mask[:, col] = True
        mask = cache.mask[:, None, None, : col + 1]
        x = inner.embed_tokens(tokens)
        for layer, fused, keys, values in zip(
            inner.layers, self._layers(), cache.keys, cache.values, strict=True
        ):
            attn = layer.self_attn
            h = _rms_norm(x, layer.input_layernorm)
            qkv = F.linear(h, fused.qkv, fused.qkv_bias).view(rows, -1, d)
            rot = qkv[:, :qk].unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)
            q_k = torch.addcmul(qkv[:, :qk] * cos, rot, sin)  # RoPE on q and k heads at once
            keys[:, :, col] = q_k[:, self.heads :]
            values[:, :, col] = qkv[:, qk:]
            out = F.scaled_dot_product_attention(
                q_k[:, : self.heads, None], keys[:, :, : col + 1], values[:, :, : col + 1],
                attn_mask=mask, scale=attn.scaling, enable_gqa=self.heads != self.kv_heads,
            )  # fmt: skip
            x = torch.addmm(x, out.view(rows, -1), attn.o_proj.weight.t())
            h = _rms_norm(x, layer.post_attention_layernorm)
            gate, up = F.linear(h, fused.gate_up, fused.gate_up_bias).chunk(2, dim=-1)
            x = torch.addmm(x, F.silu(gate) * up, layer.mlp.down_proj.weight.t())
        cache.width = col + 1
        return self.model.lm_head(_rms_norm(x, inner.norm))


class HFDecoder:
    """Any HF causal LM: its own forward over a `DynamicCache` of views into the buffers."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        cache.reserve(1)
        col = cache.width
        dynamic = DynamicCache()
        for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
            dynamic.update(k[:, :, :col], v[:, :, :col], i)
        cache.mask[:, col] = True
        out = self.model(
            input_ids=tokens[:, None], attention_mask=cache.mask[:, : col + 1].long(),
            position_ids=positions[:, None], past_key_values=dynamic, use_cache=True,
        )  # fmt: skip
        layers: list[Any] = list(dynamic.layers)
        for layer, keys, values in zip(layers, cache.keys, cache.values, strict=True):
            keys[:, :, col] = layer.keys[:, :, -1]
            values[:, :, col] = layer.values[:, :, -1]
        cache.width = col + 1
        return out.logits[:, -1, :]


def make_decoder(model: Any) -> Decoder:
    return LlamaDecoder(model) if LlamaDecoder.supports(model) else HFDecoder(model)
