"""The finiteness check every path to the engines and the checkpoint shares: the trainer's
backends (`engines/train/finite.py` says where they apply it) and the weight sender, which
checks the flattened buckets it hands the engines. One error type, so a NaN is refused the
same way (not retried: it would come back) whichever way the weights travel."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch itself only where a tensor is checked: the driver imports the error
    from torch import Tensor


class NonFiniteError(FloatingPointError):
    """A loss, gradient or weight that is NaN or inf, where continuing would store or
    broadcast it. The run stays resumable: nothing corrupt was checkpointed."""


def nonfinite_names(named: Iterable[tuple[str, Tensor]]) -> list[str]:
    """Names of the tensors holding any NaN or inf (one device-to-host read for all)."""
    import torch

    pairs = list(named)
    if not pairs:
        return []
    finite = torch.stack([torch.isfinite(t).all().to(pairs[0][1].device) for _, t in pairs])
    return [name for (name, _), ok in zip(pairs, finite.tolist(), strict=True) if not ok]


def check_finite(named: Iterable[tuple[str, Tensor]], what: str) -> None:
    """Raise `NonFiniteError` naming (the first few of) the non-finite tensors of `what`."""
    raise_nonfinite(nonfinite_names(named), what)


def raise_nonfinite(bad: list[str], what: str) -> None:
    """`NonFiniteError` naming (the first few of) `bad`, the non-finite tensors of `what`,
    however they were found (a sharded trainer finds them on every rank together)."""
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise NonFiniteError(f"{what}: {len(bad)} tensors hold NaN/inf ({shown})")
