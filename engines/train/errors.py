"""The trainer's errors that the driver classifies (tasks/retries.py: not retried), in a
module of their own: the driver imports them without torch, which the modules that raise
them need (bench/RESULTS.md, "CI cost", has the driver's import before and after)."""

from __future__ import annotations


class ParallelLayoutError(ValueError):
    """A checkpoint saved by a megatron group of another layout than the run's: its
    distributed optimizer state does not reshard (megatron's `dist_checkpointing` fails deep
    in the load, on every rank, with a `KeyError` naming a `dp_group_idx_*` key)."""


class LoraResumeError(ValueError):
    """A checkpoint's LoRA adapter does not fit the run's `train.lora` (rank, alpha or the
    modules it adapts), or a LoRA checkpoint is resumed with LoRA off: the same on every
    retry; resume with the settings it was saved with."""
