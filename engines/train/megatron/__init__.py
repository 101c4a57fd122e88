"""Megatron-core train backend (GPU only).

Nothing here imports megatron at module import time: `engines.train.megatron` must be
importable on a CPU install (and in CPU CI) where megatron-core is absent. The backend and
the model builder import it inside functions; `hf_convert` is pure torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - typing only
    from engines.train.megatron.backend import MegatronTrainBackend


def __getattr__(name: str) -> Any:
    """Lazy `from engines.train.megatron import MegatronTrainBackend`."""
    if name == "MegatronTrainBackend":
        from engines.train.megatron.backend import MegatronTrainBackend

        return MegatronTrainBackend
    raise AttributeError(name)


__all__ = ["MegatronTrainBackend"]
