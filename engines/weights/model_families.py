"""Which HF model families each engine and train backend runs, and MoE layouts.

Every path that touches a model's weights or forward (the embedded engine's decode step and
routing capture, the torch trainer's routing replay, the megatron converter, weight sync)
is written and tested per family. A model of another family may load and even run, then
train on wrong numbers or fail mid-run, so the driver refuses it before any actor starts
(`flows/bookkeeping/preflight.py`) and each backend refuses it when it is built, naming the
`model_type` and the families it supports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the driver checks families before any model is loaded, without torch
    import torch

# backend -> the HF `model_type`s it runs
SUPPORTED_FAMILIES: dict[str, tuple[str, ...]] = {
    "embedded": ("llama", "qwen2", "qwen3", "qwen3_moe"),
    "torch": ("llama", "qwen2", "qwen3", "qwen3_moe"),
    "megatron": ("llama", "qwen2", "qwen3", "qwen3_moe"),
}


class UnsupportedModelError(ValueError):
    """A model whose family a backend does not run; the message names both."""


def check_model_family(model_type: str | None, backend: str, where: str) -> None:
    """Raise `UnsupportedModelError` unless `backend` runs `model_type`; `where` names the
    config key or path the model came from."""
    supported = SUPPORTED_FAMILIES[backend]
    if model_type not in supported:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not supported by the {backend} "
            f"{'engine' if backend == 'embedded' else 'train backend'}; supported: "
            f"{', '.join(supported)}"
        )


def check_model_config(config: Any, backend: str, where: str) -> None:
    """`check_model_family` for a loaded HF config (a model's `.config`)."""
    check_model_family(getattr(config, "model_type", None), backend, where)


def moe_routers(model: torch.nn.Module) -> Iterator[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of each sparse MoE layer of an HF causal LM (Qwen3-MoE:
    `model.layers[i].mlp.gate`, which returns `(logits, top-k weights, top-k ids)`); none
    for a dense model. Layers listed in `mlp_only_layers` have no router."""
    inner: Any = getattr(model, "module", model)  # DDP
    get_base = getattr(inner, "get_base_model", None)  # peft
    base = get_base() if callable(get_base) else inner
    layers = getattr(getattr(base, "model", None), "layers", None) or []
    import torch

    for i, layer in enumerate(layers):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if isinstance(gate, torch.nn.Module) and hasattr(gate, "top_k"):
            yield i, gate


def moe_layout(config: Any) -> tuple[int, int] | None:
    """(decoder layers, experts per token) of an MoE config, the shape of one token's routed
    experts (SGLang's `routed_experts`: every layer, -1 where a layer has no router); None
    for a dense model."""
    top_k = getattr(config, "num_experts_per_tok", None)
    if not getattr(config, "num_experts", None) or not top_k:
        return None
    return int(config.num_hidden_layers), int(top_k)
