"""An embedded engine actor served in the test process, for the tests that talk HTTP to one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engines.inference.engine_actor import EngineActor
from flows.config.run import EngineConfig


@contextmanager
def embedded_engine(model_dir: str) -> Iterator[EngineActor]:
    """One-thread engine on `model_dir`; the process's torch thread count is restored after
    (the actor sets its own)."""
    threads = torch.get_num_threads()
    actor = EngineActor(EngineConfig(backend="embedded", model_path=model_dir), 0, num_threads=1)
    try:
        yield actor
    finally:
        actor.shutdown()
        torch.set_num_threads(threads)
