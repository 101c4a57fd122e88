"""Files of a torch-backend checkpoint next to the HF `save_pretrained` weights.

    config.json, model.safetensors, tokenizer*   the policy (HF format; merged weights for LoRA)
    adapter/                                     LoRA only: the adapter in PEFT format
                                                 (adapter_model.safetensors, adapter_config.json)
    optimizer.pt, scheduler.pt                   actor optimizer + LR scheduler
    critic/, critic_optimizer.pt, critic_scheduler.pt   (ppo only)
    rng.pt                                       global torch (+ CUDA) RNG and the shuffle generator
    meta.json                                    weight version, backend
    MANIFEST.json                                size + sha256 of every file above, written last

Everything a resumed run needs to take exactly the step an uninterrupted run would. The
manifest makes a stored copy recognisably complete whatever order its files were uploaded
in (`storage/run_layout.py` scans for complete checkpoints), and lets a load detect a file
altered since (`verify_checkpoint`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from storage import integrity
from storage.object_store import ObjectStore

META_FILE = "meta.json"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
CRITIC_OPTIMIZER_FILE = "critic_optimizer.pt"
CRITIC_SCHEDULER_FILE = "critic_scheduler.pt"
RNG_FILE = "rng.pt"


def save_state(local_dir: str, name: str, state: dict[str, Any]) -> None:
    torch.save(state, os.path.join(local_dir, name))


def load_state(local_dir: str, name: str) -> dict[str, Any]:
    path = os.path.join(local_dir, name)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {local_dir}: missing {name}")
    state: dict[str, Any] = torch.load(path, weights_only=True, map_location="cpu")
    return state


def rng_state(shuffle: torch.Generator) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "shuffle": shuffle.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], shuffle: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    shuffle.set_state(state["shuffle"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_meta(local_dir: str, version: int) -> None:
    with open(os.path.join(local_dir, META_FILE), "w") as f:
        json.dump({"version": version, "backend": "torch"}, f)


def read_version(local_dir: str) -> int:
    with open(os.path.join(local_dir, META_FILE)) as f:
        return int(json.load(f)["version"])


def has_checkpoint(local_dir: str) -> bool:
    return os.path.exists(os.path.join(local_dir, META_FILE))


def write_manifest(local_dir: str) -> None:
    """Call last when saving into `local_dir`: every file's size and sha256 (local reads)."""
    store = ObjectStore(local_dir)
    manifest = integrity.dir_manifest(store, skip=(integrity.MANIFEST_FILE,))
    integrity.write_manifest(store, manifest)


def verify_checkpoint(local_dir: str) -> None:
    """Raise `CorruptFileError` naming the first file that is missing or differs (size or
    sha256) from the manifest; a checkpoint saved without one is taken as it is."""
    store = ObjectStore(local_dir)
    manifest = integrity.read_manifest(store)
    if manifest is None:
        return
    problems = integrity.check_dir(store, manifest, checksums=True)
    if problems:
        raise problems[0]
