"""Run a megatron GPTModel's output layer on the response positions only.

The step needs logits (or critic values) only where they predict a response token. The
plain GPTModel projects every position (prompt and padding too) to `[s, b, V]` and returns
it transposed to `[b, s, V]` with a full copy: on a Qwen2-0.5B shape at 4k tokens that vocab
projection and its copies were a third of the step's GPU time. `select_positions` arms a
forward pre-hook on the model's output layer for the next forward: the layer's input
`[s, b, h]` is cut to the `[B, R]` slots' positions, laid out as `[B*R, 1, h]`, so the model
returns `[1, B*R, V]` (its transpose then moves nothing) and `response_view` reshapes that to
`[B, R, V]`. The selection is the same on every TP rank (no sequence parallelism here).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from engines.train.batching import slot_rows

_ARMED = "_rollflow_response_positions"


def output_layer(model: Any) -> nn.Module | None:
    """The GPTModel's output layer under any DDP / Float16Module wrappers (None off the
    last pipeline stage)."""
    while not hasattr(model, "output_layer") and hasattr(model, "module"):
        model = model.module
    return getattr(model, "output_layer", None)


def _cut_hidden(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    positions = getattr(module, _ARMED, None)
    if positions is None:
        return None
    setattr(module, _ARMED, None)  # one forward per arming
    index, row = positions
    hidden = args[0][index, row]  # [s, b, h] at (position, row) per slot -> [B, R, h]
    return (hidden.reshape(-1, 1, hidden.shape[-1]), *args[1:]), kwargs


def select_positions(model: Any, logit_index: Tensor, logit_row: Tensor | None) -> bool:
    """Make the model's next forward project only `[B, R]` slot positions (`logit_row`:
    which input row holds each slot, default row b for sample b). False where this stage
    has no output layer (it then returns hidden states anyway)."""
    layer = output_layer(model)
    if layer is None:
        return False
    if getattr(layer, "sequence_parallel", False):
        raise NotImplementedError("response-only output layer: no sequence parallelism")
    if not getattr(layer, "_rollflow_hooked", False):
        layer.register_forward_pre_hook(_cut_hidden, with_kwargs=True)
        layer._rollflow_hooked = True  # type: ignore[assignment]
    setattr(layer, _ARMED, (logit_index, slot_rows(logit_index, logit_row)))
    return True


def response_view(output: Tensor, logit_index: Tensor) -> Tensor:
    """The model's `[1, B*R, X]` output of a `select_positions` forward as `[B, R, X]`."""
    rows, slots = logit_index.shape
    return output.reshape(rows, slots, output.shape[-1])
