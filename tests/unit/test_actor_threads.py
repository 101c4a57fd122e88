"""torch threads in the run's actors: `cluster.actor_num_threads: null` means the machine's
cores, although Ray starts an actor that reserves no CPU (as rollflow's do without
placement) with OMP_NUM_THREADS=1, which alone would hold torch to one core."""

from __future__ import annotations

from engines import process
from engines.process import actor_threads


def test_configured_count_wins_and_none_splits_the_cores(monkeypatch):
    monkeypatch.setattr(process, "machine_cores", lambda: 8)
    assert actor_threads(3) == 3
    assert actor_threads(3, sharers=4) == 3
    assert actor_threads(None) == 8
    assert actor_threads(None, sharers=2) == 4
    assert actor_threads(None, sharers=16) == 1  # never 0


