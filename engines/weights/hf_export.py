"""What an engine (or a plain Hugging Face load) gets from an HF model or a peft LoRA model:
its weights under the base model's own names, merged for LoRA, as tensors or as a directory.

For LoRA, each adapted layer's W + scale * B @ A is computed beside the trained module, never
merged into it: merging then unmerging in place does not give W back bit for bit, and a
resumed run must match an uninterrupted one (engines/train/lora.py).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor
from transformers import PreTrainedModel

if TYPE_CHECKING:
    from peft import PeftModel


class NotHFModelError(TypeError):
    """`save_hf` got a module that is neither a Hugging Face model nor a PeftModel."""


def peft_model_of(model: torch.nn.Module) -> PeftModel | None:
    """`model` if it carries peft adapters. A PeftModel can only exist once peft was
    imported, so a full fine-tuning run never pays for importing it here."""
    peft = sys.modules.get("peft")
    return model if peft is not None and isinstance(model, peft.PeftModel) else None


@torch.no_grad()
def engine_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The weights an engine (or a plain HF load) expects, named as in the base model's
    `state_dict`: the model's own for full fine-tuning; for LoRA, each adapted layer's
    W + scale * B @ A (peft's `get_delta_weight`), without lora_A/B tensors or peft's
    `base_model.model.` / `.base_layer.` parts of the names."""
    peft_model = peft_model_of(model)
    if peft_model is None:
        return model.state_dict()
    from peft.tuners.lora import LoraLayer

    inner = peft_model.get_base_model()
    merged: dict[str, Tensor] = {}
    for key, tensor in inner.state_dict().items():
        if ".lora_" not in key:
            merged[key.replace(".base_layer.", ".")] = tensor
    for name, module in inner.named_modules():
        if isinstance(module, LoraLayer) and not module.merged and not module.disable_adapters:
            layer: Any = module  # lora.Linear / Embedding / Conv: each has get_delta_weight
            weight = layer.get_base_layer().weight
            for adapter in layer.active_adapters:
                weight = weight + layer.get_delta_weight(adapter)
            merged[f"{name}.weight"] = weight
    return merged


def save_hf(model: torch.nn.Module, path: str) -> None:
    """A directory `AutoModelForCausalLM.from_pretrained` loads as is (merged for LoRA)."""
    peft_model = peft_model_of(model)
    if peft_model is None:
        if not isinstance(model, PreTrainedModel):
            raise NotHFModelError(f"{type(model).__name__} has no save_pretrained")
        model.save_pretrained(path)
        return
    base = cast(PreTrainedModel, peft_model.get_base_model())
    base.save_pretrained(path, state_dict=engine_state_dict(peft_model))
