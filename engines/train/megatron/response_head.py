"""Run a megatron GPTModel's output layer on the real response positions only.

The step needs logits (or critic values) only where they predict a response token. The
plain GPTModel projects every position (prompt and padding too) to `[s, b, V]` and returns
it transposed to `[b, s, V]` with a full copy: on a Qwen2-0.5B shape at 4k tokens that vocab
projection and its copies were a third of the step's GPU time. Projecting the `[B, R]`
response slots instead still projects every sample to the micro-batch's longest response R,
which is most of the slots where lengths vary (a packed micro-batch gathers samples of very
different lengths, and RL responses have a long tail): `ResponseSlots` lists the N real
slots, `select_positions` arms a forward pre-hook on the model's output layer for the next
forward that cuts its input `[s, b, h]` to those slots' positions, laid out as `[N, 1, h]`,
so the model returns `[1, N, V]` (its transpose then moves nothing); per-token results of
those N rows go back to response space with `ResponseSlots.scatter` (zero at padding slots).
The selection is the same on every TP rank (no sequence parallelism here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from engines.train.batching import PaddedBatch, slot_rows

_ARMED = "_rollflow_response_positions"


@dataclass(frozen=True, slots=True)
class ResponseSlots:
    """A batch's real response slots (those `response_mask` marks), N of them in row-major
    order. `index` is `[3, N]` int64 (one tensor: one copy to the device): each slot's flat
    index in `[B, R]` response space, then the input position and input row whose hidden
    state predicts it. `shape`: (B, R)."""

    index: Tensor
    shape: tuple[int, int]

    @classmethod
    def of(cls, batch: PaddedBatch) -> ResponseSlots:
        """The real slots of `batch` (built where the batch is, the CPU: no device sync)."""
        flat = batch.response_mask.flatten().nonzero().squeeze(1)
        position = batch.logit_index.flatten()[flat]
        row = slot_rows(batch.logit_index, batch.logit_row).flatten()[flat]
        rows, width = batch.logit_index.shape
        return cls(torch.stack([flat, position, row]), (rows, width))

    def to(self, device: torch.device, non_blocking: bool = False) -> ResponseSlots:
        """On `device`; `non_blocking` from pinned memory (see `PaddedBatch.to`)."""
        index = self.index.pin_memory() if non_blocking and device.type == "cuda" else self.index
        return ResponseSlots(index.to(device, non_blocking=non_blocking), self.shape)

    def gather(self, x: Tensor) -> Tensor:
        """`[B, R, ...]` response-space values at the real slots: `[N, ...]`."""
        return x.flatten(0, 1)[self.index[0]]

    def scatter(self, x: Tensor) -> Tensor:
        """`[N]` per-slot values -> `[B, R]` in response space, 0 at every other slot (so
        padding slots hold a finite value with no gradient); differentiable."""
        rows, width = self.shape
        out = x.new_zeros(rows * width).scatter(0, self.index[0], x)
        return out.view(rows, width)


def output_layer(model: Any) -> nn.Module | None:
    """The GPTModel's output layer under any DDP / Float16Module wrappers (None off the
    last pipeline stage)."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "output_layer", None)


def _cut_hidden(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    slots = getattr(module, _ARMED, None)
    if slots is None:
        return None
    setattr(module, _ARMED, None)  # one forward per arming
    hidden = args[0][slots.index[1], slots.index[2]]  # [s, b, h] at (position, row) -> [N, h]
    return (hidden.unsqueeze(1), *args[1:]), kwargs


def select_positions(model: Any, slots: ResponseSlots) -> bool:
    """Make the model's next forward project only the positions of `slots` (its output then
    is `[1, N, X]`). False where this stage has no output layer (it then returns hidden
    states anyway)."""
    layer = output_layer(model)
    if layer is None:
        return False
    if getattr(layer, "sequence_parallel", False):
        raise NotImplementedError("response-only output layer: no sequence parallelism")
    if not getattr(layer, "_rollflow_hooked", False):
        layer.register_forward_pre_hook(_cut_hidden, with_kwargs=True)
        layer._rollflow_hooked = True  # type: ignore[assignment]
    setattr(layer, _ARMED, slots)
    return True
