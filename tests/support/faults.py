"""Running a training with a fault fired mid-run, and what a run trained on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import ray

from engines.cluster.registry import get_run_actor
from storage.batch_io import read_samples
from storage.run_layout import RunLayout

THREE_STEPS = ("rollout.num_rollout=3",)  # long enough to fire a fault in step 1


def trained_indices(cfg) -> list[int]:
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    return [s.index for k in layout.committed_steps()
            for s in read_samples(layout.store, f"steps/{k:06d}", "train.arrow")]


def run_with_fault(cfg, when: Callable[[RunLayout], bool], fault: Callable[[], None]) -> dict:
    """Run the train flow in a thread; fire `fault` once `when(layout)` holds."""
    from flows.train import train

    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(train(cfg)))
    thread.start()
    fired = False
    while thread.is_alive():
        if not fired and when(layout):
            fault()
            fired = True
        time.sleep(0.01)
    thread.join()
    assert fired, "the fault never fired"
    assert result, "the train flow did not return"
    return result


def kill(cfg, role):
    ray.kill(get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, role))
