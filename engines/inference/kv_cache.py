"""The embedded engine's KV cache and what ends its rows, apart from the decode steps that
use them (`kv_decode`, `cuda_graph_decode`) and the batch that owns them (`decode_batch`).

`KVCache` keeps each layer's keys and values in one preallocated buffer that grows by chunks:
a decode step writes one column in place, where HF's `DynamicCache` re-concatenated every
layer's keys and values each step (O(length) copies per token; `kv_decode` says where that
was measured). `RowFinish` is what a step run without Python in between needs to
know to stop at the token where a row finishes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

_CHUNK = 64  # columns added when a cache fills up (plus half its size, for amortized growth)


def _buffer(like: torch.Tensor, rows: int, capacity: int) -> torch.Tensor:
    """`[rows, kv_heads, 2, capacity, head_dim]`: keys at index 0 of dim 2, values at 1.
    Rows and heads stay one batch dimension of the keys (and of the values), so attention's
    batched matmuls read them in place; with keys|values outermost in a row they copied
    both for every layer and step (a third of a decode step at batch 64)."""
    return like.new_zeros(rows, like.shape[1], 2, capacity, like.shape[3])


@dataclass(slots=True, weakref_slot=True)  # (a captured graph notes which cache it serves)
class KVCache:
    """Left-padded keys and values, one `[rows, kv_heads, 2, capacity, head_dim]` buffer
    per layer (keys at index 0 of dim 2, values at 1, so a step stores both with one copy).

    Columns `[0, width)` hold tokens; `mask[:, :width]` marks which are real (not padding),
    `padded` whether any of them is padding. Every row appends at column `width`, so a step
    writes one column in place.
    """

    layers: list[torch.Tensor]
    mask: torch.Tensor  # bool [rows, capacity]
    width: int
    padded: bool = True

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    @property
    def column_bytes(self) -> int:
        """Bytes one more column costs: every layer's keys and values for every row, and
        the mask's entry per row."""
        kv = sum(x.numel() // x.shape[3] * x.element_size() for x in self.layers)
        return kv + self.mask.shape[0] * self.mask.element_size()

    @property
    def keys(self) -> list[torch.Tensor]:
        return [x[:, :, 0] for x in self.layers]

    @property
    def values(self) -> list[torch.Tensor]:
        return [x[:, :, 1] for x in self.layers]

    @classmethod
    def from_prefill(
        cls, cache: DynamicCache, attn: torch.Tensor, room: int, rows: torch.Tensor | None = None
    ) -> KVCache:
        """Copy a prefill's `DynamicCache` (mask `attn`) into buffers with `room` free columns;
        `rows` picks (and repeats) the prefill's rows, so a prompt shared by several requests
        is prefilled once."""
        if rows is not None:
            attn = attn[rows]
        count, width = attn.shape
        kv = cls([], attn.new_zeros(count, width + room, dtype=torch.bool), width)
        kv.mask[:, :width] = attn.bool()
        for layer in list[Any](cache.layers):
            keys, values = layer.keys, layer.values
            if rows is not None:
                keys, values = keys[rows], values[rows]
            buf = _buffer(keys, count, width + room)
            buf[:, :, 0, :width] = keys
            buf[:, :, 1, :width] = values
            kv.layers.append(buf)
        kv._check_padding()
        return kv

    def reserve(self, columns: int, spare: bool = True) -> None:
        """Make room for `columns` more tokens (copying into larger buffers if needed), with
        `spare` columns beyond them for amortized growth."""
        need = self.width + columns
        if need > self.capacity:
            self._resize(None, 0, need + max(_CHUNK, need // 2) if spare else need)

    def select(self, rows: torch.Tensor, trim: int, room: int) -> KVCache:
        """Rows `rows` without the first `trim` columns, with `room` free columns."""
        out = KVCache(list(self.layers), self.mask, self.width)
        out._resize(rows, trim, self.width - trim + room)
        return out

    def _resize(self, rows: torch.Tensor | None, trim: int, capacity: int) -> None:
        width = self.width - trim
        mask = self.mask if rows is None else self.mask[rows]
        self.mask = mask.new_zeros(mask.shape[0], capacity)
        self.mask[:, :width] = mask[:, trim : trim + width]
        for i, x in enumerate(self.layers):
            src = x if rows is None else x[rows]
            self.layers[i] = _buffer(src[:, :, 0], src.shape[0], capacity)
            self.layers[i][..., :width, :] = src[..., trim : trim + width, :]
        self.width = width
        self._check_padding()

    def _check_padding(self) -> None:
        self.padded = not bool(self.mask[:, : self.width].all())

    @staticmethod
    def concat(a: KVCache, b: KVCache, room: int) -> KVCache:
        """Rows of `a` then `b`, right-aligned to the wider of the two (left padding)."""
        width = max(a.width, b.width)
        na, rows = a.mask.shape[0], a.mask.shape[0] + b.mask.shape[0]
        out = KVCache([], a.mask.new_zeros(rows, width + room), width)
        for start, end, src in ((0, na, a), (na, rows, b)):
            out.mask[start:end, width - src.width : width] = src.mask[:, : src.width]
        for xa, xb in zip(a.layers, b.layers, strict=True):
            buf = _buffer(xa[:, :, 0], rows, width + room)
            for start, end, src, x in ((0, na, a, xa), (na, rows, b, xb)):
                buf[start:end, ..., width - src.width : width, :] = x[..., : src.width, :]
            out.layers.append(buf)
        out._check_padding()
        return out


@dataclass(frozen=True, slots=True)
class RowFinish:
    """What ends each row, for steps run without Python in between: `live` (bool [rows]),
    `left` tokens of budget (int64 [rows]), `stop_ids` (int64 [rows, n], -1 pads), the
    fewest tokens a live row has left (no turn runs longer: that row ends it) and the most
    (no live row needs cache columns beyond them)."""

    live: torch.Tensor
    left: torch.Tensor
    stop_ids: torch.Tensor
    fewest_left: int
    most_left: int = 1 << 30
