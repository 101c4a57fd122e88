"""Keep Python's full garbage collections off the step's clock in long-lived processes.

A rollflow actor holds ~500,000 objects the collector tracks once it has started (torch,
transformers, the prompt set, its modules' functions and dicts), and they live as long as
the process does. Every full (generation-2) collection walks all of them: measured in the
rollout manager next to an embedded engine, 0.26-0.43 s each, and one fell into every
fourth generate call of the main job (0.85 s instead of 0.35 s); the driver made 9 such
collections in a 14-step run, up to 0.57 s each. `gc.freeze()` moves what exists now into
a permanent generation that collections skip; what a step allocates is still collected.
A frozen object that later dies is still freed by reference counting; only a reference
cycle among such objects stays until `gc.unfreeze()`.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def _in_ray_actor() -> bool:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def freeze_actor_heap() -> None:
    """In a Ray actor's process, which the actor owns for its life: collect what is garbage
    now, then exempt every survivor from later collections. Elsewhere (an actor class built
    in-process, as tests and benchmarks do) nothing happens: that process is not the
    actor's to freeze."""
    if _in_ray_actor():
        gc.collect()
        gc.freeze()


@contextmanager
def long_lived_frozen() -> Iterator[None]:
    """The driver's version: what exists on entry is frozen until exit, when it goes back
    to the collector (so a process that runs several flows does not keep their cycles). A
    process that froze its heap itself keeps doing so: nothing is frozen or unfrozen here."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
