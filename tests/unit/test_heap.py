"""engines.process: long-lived objects frozen out of full collections, where that is safe."""

from __future__ import annotations

import gc

from engines.process import long_lived_frozen


def test_the_driver_freezes_for_the_run_and_gives_it_back() -> None:
    before = gc.get_freeze_count()
    with long_lived_frozen():
        assert gc.get_freeze_count() > before
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_its_owner_stays_frozen() -> None:
    gc.freeze()
    try:
        owned = gc.get_freeze_count()
        with long_lived_frozen():
            pass
        # Frozen objects can still die by reference counting (the count then drops by a
        # few), but an unfreeze would have emptied the permanent generation.
        assert gc.get_freeze_count() > owned // 2
    finally:
        gc.unfreeze()


