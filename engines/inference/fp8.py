"""FP8 rollouts (`engine.dtype: fp8`): the embedded engine's decoder-layer projections in
float8 (e4m3), as SGLang's `--quantization fp8` serves an unquantized checkpoint.

    weight  [out, in]  float8, one float32 scale per output row (its absolute max / 448),
                       quantized when the weights load and at every weight update;
    input   [rows, in] quantized per row as it arrives (dynamic scaling);
    product torch._scaled_mm: float8 x float8 with float32 accumulation, both scales
                       applied to the output, in bfloat16.

Embeddings, norms, attention and the LM head stay bfloat16 (the head's logits are the
log-probs the trainer compares). An H100 runs the float8 matmul at twice bfloat16's rate and
the weights take half the memory; on a CPU `_scaled_mm` computes the same products, slowly.
The engine's log-probs then differ from the trainer's more than in bfloat16: the step
metrics report the gap (`train/rollout_logprob_abs_diff`, the corrections' mismatch KL).
Figures: bench/RESULTS.md, "FP8 rollouts".
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_ALIGN = 16  # _scaled_mm needs both matrix dims of the weight to be multiples of 16


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """`x` `[rows, n]` as float8 and its per-row float32 scales `[rows, 1]`:
    `x ~= fp8.float() * scale`."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """`x @ (weight * scale).T + bias` for a float8 `weight` `[out, in]` with row scales
    `scale` `[out]`: `x` quantized per row, in `x`'s dtype."""
    rows = x.reshape(-1, x.shape[-1])
    x8, x_scale = quantize_rows(rows)
    out = torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                           out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


class Fp8Linear(nn.Module):
    """An `nn.Linear` whose weight is float8 with per-row scales. The weight keeps its name
    (`weight`), so checkpoints, weight updates and the lean decode step find it where an
    HF model has it; the scales are not part of the state dict (`load` recomputes them)."""

    weight_scale: Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantize_rows(linear.weight.detach())
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale", scale.view(-1), persistent=False)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)

    @torch.no_grad()
    def load(self, weight: Tensor) -> None:
        """Quantize `weight` (a trainer's, any float dtype) into this layer, in place."""
        quantized, scale = quantize_rows(weight.to(self.weight.device))
        self.weight.copy_(quantized)
        self.weight_scale.copy_(scale.view(-1))

    def dequantized(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The weight this layer computes with, as a plain tensor (`load` of it gives back
        the same float8 values and scales)."""
        return (self.weight.float() * self.weight_scale.view(-1, 1)).to(dtype)


def quantize_model(model: nn.Module) -> dict[str, Fp8Linear]:
    """Replace the `nn.Linear`s of `model`'s decoder layers (`model.model.layers`) by
    `Fp8Linear`s, in place; the embeddings and LM head stay as they are. Returns the
    quantized layers by their weight's parameter name. Every projection's dims must be
    multiples of 16 (`_scaled_mm`'s), or nothing is quantized and the error names it."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"engine.dtype fp8: {type(model).__name__} has no model.layers to "
                         "quantize (a decoder-only transformers model is needed)")
    linears = [(layer, name, child) for layer in layers
               for name, child in layer.named_modules() if isinstance(child, nn.Linear)]
    for _, name, child in linears:
        if child.in_features % _ALIGN or child.out_features % _ALIGN:
            raise ValueError(
                f"engine.dtype fp8: {name} is {child.out_features} x {child.in_features}; the "
                f"float8 matmul needs both dims to be multiples of {_ALIGN}")
    for layer, name, child in linears:
        parent_name, _, attr = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        setattr(parent, attr, Fp8Linear(child))
    return quantized_layers(model)


def quantized_layers(model: nn.Module) -> dict[str, Fp8Linear]:
    """The `Fp8Linear`s of `model` by their weight's parameter name."""
    return {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, Fp8Linear)}
