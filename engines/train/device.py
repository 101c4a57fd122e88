"""The trainer's device choice, apart from the model plumbing (`torch_models`) so that asking
it imports only torch: a mock trainer asks it at every weight sync, and `torch_models` pulls in
transformers' modeling code, about half a mock train actor's CPU (bench/RESULTS.md, "CI cost")."""

from __future__ import annotations

import os

import torch


def resolve_device(choice: str) -> torch.device:
    """`auto`: this process's GPU (LOCAL_RANK) when CUDA is present, else the CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("train.device is 'cuda' but CUDA is not available")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
