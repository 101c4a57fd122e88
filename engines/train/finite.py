"""Non-finite values never reach the weights, a checkpoint or the engines.

One NaN (a reward, an advantage, an overflowing log-ratio) makes the loss NaN, the gradient
NaN and, after one optimizer step, every parameter NaN -- and a run that saves and pushes
them still exits 0. So, in every train backend:

    grad norm not finite (loss finite)  -> the optimizer step is skipped and counted
                                           (`skipped_steps`), as megatron does on fp16 overflow
    loss not finite                     -> the step is skipped and train() raises
    a parameter not finite after train  -> train() raises, before the version moves on
    weights for the engines / checkpoint -> checked again, refused if not finite

A train() that raises part-way has already taken some optimizer steps: its backend is marked
`STALE_VERSION`, which no rollout id equals, so the train actor rebuilds it from the last
checkpoint plus replay before training again instead of training on half-updated weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

from engines.weights.finite import NonFiniteError, check_finite, nonfinite_names, raise_nonfinite

__all__ = ["STALE_VERSION", "NonFiniteError", "check_finite", "nonfinite_names",
           "raise_nonfinite", "stale_on_failure"]

STALE_VERSION = -1
"""The weight version of a backend whose train() failed after changing its weights."""


class Versioned(Protocol):
    version: int


@contextmanager
def stale_on_failure(backend: Versioned, rollout_id: int) -> Iterator[None]:
    """Around one train(): refuse a backend a failed train() left stale, and leave this one
    stale if it fails part-way (a `NonFiniteError` also says which rollout)."""
    check_not_stale(backend.version)
    try:
        yield
    except NonFiniteError as exc:
        backend.version = STALE_VERSION
        raise NonFiniteError(f"rollout {rollout_id}: {exc}") from exc
    except BaseException:
        backend.version = STALE_VERSION
        raise


def check_not_stale(version: int) -> None:
    """Refuse to train on the half-updated weights a failed train() left behind."""
    if version == STALE_VERSION:
        raise RuntimeError(
            "this train backend's last train() failed part-way, so its weights belong to no "
            "weight version; rebuild it from a checkpoint (TrainActor.ensure_version) first"
        )
