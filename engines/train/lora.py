"""LoRA on the torch backend (`train.lora`), through peft.

With `train.lora.rank > 0` the policy is the base model (`train.model_path`) with peft LoRA
adapters on `target_modules`, and:

- only the adapter weights require grad, so only they reach the optimizer (and its state);
- the KL reference is the same model with its adapters disabled (peft's `disable_adapter`).
  The base is frozen, so base-without-adapters *is* the initial policy: no second copy of
  the model is loaded, which is much of LoRA's memory saving;
- engines, the disk weight sync and the model a checkpoint holds get merged weights
  W + alpha / r * B @ A under the base model's own names (`engine_state_dict`). They are
  computed beside the trained module, never merged into it: merging then unmerging in place
  does not give W back bit for bit, and a resumed run must match an uninterrupted one;
- a checkpoint directory is a plain HF model (merged; loads with
  `AutoModelForCausalLM.from_pretrained`) plus `adapter/` in PEFT format
  (adapter_model.safetensors + adapter_config.json), from which training resumes on the base.

peft is imported only when LoRA is on: its import alone takes seconds.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from engines.config.train import LoraConfig, TrainConfig
from engines.train.errors import LoraResumeError
from engines.train.torch_models import load_causal_lm
from engines.weights.hf_export import peft_model_of, save_hf
from storage.sample import Sample

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    # peft 0.21 reads `is_gradient_checkpointing`, which transformers 5 deprecates.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        yield


def peft_config(cfg: LoraConfig) -> Any:
    import peft

    return peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        target_modules=cfg.target_modules,
        lora_dropout=cfg.dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def load_policy(cfg: TrainConfig, base_path: str, source: str, device: torch.device) -> Any:
    """The trainable policy. Without LoRA: the HF model at `source`. With LoRA: the base at
    `base_path` with fresh adapters, or with those saved in `source/adapter` when `source`
    is a checkpoint of the run (resume, `train.load`)."""
    same = os.path.abspath(source) == os.path.abspath(base_path)
    resuming = not same or (cfg.load is not None and source == cfg.load)
    if not cfg.lora.enabled:
        if resuming and os.path.isdir(os.path.join(source, ADAPTER_DIR)):
            raise LoraResumeError(
                f"checkpoint {source} was trained with LoRA (it holds {ADAPTER_DIR}/): resume it "
                "with the train.lora settings it was saved with, or make it train.model_path to "
                "fully fine-tune its merged weights"
            )
        return load_causal_lm(source, device)
    import peft

    base = load_causal_lm(base_path, device)
    with _quiet_peft():
        if resuming:
            adapter = os.path.join(source, ADAPTER_DIR)
            _check_saved_adapter(adapter, cfg.lora, base)
            model = peft.PeftModel.from_pretrained(base, adapter, is_trainable=True)
        else:
            model = peft.get_peft_model(base, peft_config(cfg.lora))
    torch.nn.Module.to(model, device)
    return model


def adapted_modules(config: Any, base: torch.nn.Module) -> set[str]:
    """Names of the modules of `base` that peft `config` puts adapters on. Compared as sets,
    since peft saves 'all-linear' as the module names it resolved it to, and a list of
    suffixes and a regex may name the same modules."""
    from peft.tuners.tuners_utils import (
        _maybe_include_all_linear_layers,  # peft's own 'all-linear' resolution
        check_target_module_exists,
    )

    resolved = _maybe_include_all_linear_layers(copy.copy(config), base)
    return {name for name, _ in base.named_modules()
            if name and check_target_module_exists(resolved, name)}


def _names(modules: set[str], limit: int = 4) -> str:
    shown = sorted(modules)[:limit]
    return ", ".join(shown) + (f" and {len(modules) - limit} more" if len(modules) > limit else "")


def _check_saved_adapter(adapter_dir: str, cfg: LoraConfig, base: torch.nn.Module) -> None:
    """A checkpoint resumes only into the rank, alpha and adapted modules it was saved with
    (`base` says which modules each `target_modules` names)."""
    import peft

    if not os.path.isfile(os.path.join(adapter_dir, ADAPTER_CONFIG)):
        raise FileNotFoundError(
            f"checkpoint {os.path.dirname(adapter_dir)}: no LoRA adapter ({ADAPTER_DIR}/"
            f"{ADAPTER_CONFIG}); with train.lora.rank > 0, train.load must be a checkpoint of a "
            "LoRA run (to put adapters on a fully trained model, make it train.model_path)"
        )
    saved = peft.LoraConfig.from_pretrained(adapter_dir)
    for key, have, want in (("rank", saved.r, cfg.rank), ("alpha", saved.lora_alpha, cfg.alpha)):
        if have != want:
            raise LoraResumeError(
                f"train.lora.{key}={want} differs from the checkpoint's adapter ({have} in "
                f"{adapter_dir}); resume with the settings it was saved with"
            )
    have_modules = adapted_modules(saved, base)
    want_modules = adapted_modules(peft_config(cfg), base)
    if have_modules != want_modules:
        only_config, only_saved = want_modules - have_modules, have_modules - want_modules
        targets = saved.target_modules
        raise LoraResumeError(
            f"train.lora.target_modules={cfg.target_modules!r} adapts other modules than the "
            f"checkpoint's adapter (saved with target_modules "
            f"{targets if isinstance(targets, str) else sorted(targets)!r} in {adapter_dir})"
            + (f"; only in the config: {_names(only_config)}" if only_config else "")
            + (f"; only in the checkpoint: {_names(only_saved)}" if only_saved else "")
            + "; resume with the settings it was saved with"
        )


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer gets: every parameter for full fine-tuning, the adapters for LoRA."""
    return [p for p in module.parameters() if p.requires_grad]


def save_policy(model: torch.nn.Module, local_dir: str) -> None:
    """A checkpoint's policy: the HF model (`save_hf`), and for LoRA the adapter in PEFT
    format under `adapter/`, which `load_policy` resumes from."""
    save_hf(model, local_dir)
    peft_model = peft_model_of(model)
    if peft_model is not None:
        peft_model.save_pretrained(os.path.join(local_dir, ADAPTER_DIR))


ScoreFn = Callable[[list[Sample]], list[Tensor]]


def without_adapters(model: torch.nn.Module, score: ScoreFn) -> ScoreFn:
    """`score` run with `model`'s adapters off: the frozen base, i.e. the initial policy."""
    peft_model = peft_model_of(model)
    if peft_model is None:
        raise TypeError("without_adapters needs a model with LoRA adapters")

    def scorer(samples: list[Sample]) -> list[Tensor]:
        with peft_model.disable_adapter():
            return score(samples)

    return scorer
