"""Which experts an MoE model routed each token to, recorded as the engine runs it.

The trainer recomputes a rollout's log-probs with its own forward; in an MoE model a token
whose router scores two experts nearly alike can be sent to another expert there (other
kernels, batch shapes, precision), and its log-prob then differs far more than a dense
model's. Routing replay (`algorithm.routing_replay`) hands the trainer the experts the
engine chose. SGLang returns them with `return_routed_experts` (base64 of int32
`[prompt + completion - 1, layers, topk]` in `meta_info["routed_experts"]`): every token the
engine fed to the model, prompt included; the last sampled token is never fed.

`RoutingCapture` keeps the top-k ids each router returned in the last forward (a forward
hook per router: the model's own routing, untouched); the generator slices them per request.
"""

from __future__ import annotations

import base64
import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.weights.model_families import moe_layout, moe_routers

if TYPE_CHECKING:  # the capture is made for a model, torch long imported; the wire encoding
    # is the HTTP server's, which the mock engine runs without torch (mock_generator.py)
    import torch


class RoutingCapture:
    """Top-k expert ids of the last forward of an MoE model, per router."""

    def __init__(self, model: torch.nn.Module, layout: tuple[int, int]) -> None:
        self.layers, self.topk = layout
        self._ids: dict[int, torch.Tensor] = {}
        self._handles = [
            router.register_forward_hook(functools.partial(self._keep, layer))
            for layer, router in moe_routers(model)
        ]

    @classmethod
    def of(cls, model: torch.nn.Module) -> RoutingCapture | None:
        """A capture for an MoE model, None for a dense one."""
        layout = moe_layout(getattr(model, "config", None))
        return None if layout is None else cls(model, layout)

    def _keep(self, layer: int, module: Any, args: Any, output: Any) -> None:
        self._ids[layer] = output[2]  # (logits, top-k weights, top-k ids)

    def take(self, rows: int, width: int) -> torch.Tensor:
        """The last forward's ids as int16 `[rows, width, layers, topk]` on the CPU (its
        tokens were `[rows, width]`), -1 for layers without a router; then forgets them."""
        import torch

        out = torch.full((rows, width, self.layers, self.topk), -1, dtype=torch.int16)
        for layer, ids in self._ids.items():
            out[:, :, layer] = ids.reshape(rows, width, self.topk).to("cpu", torch.int16)
        self._ids.clear()
        return out


def encode_routed_experts(ids: np.ndarray) -> str:
    """SGLang's wire form: base64 of little-endian int32."""
    return base64.b64encode(np.ascontiguousarray(ids, dtype="<i4").tobytes()).decode("ascii")
