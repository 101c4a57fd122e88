"""torch's intra-op thread count in the run's actors.

Ray sets `OMP_NUM_THREADS=1` in every actor that reserves no CPU, which is how rollflow's
actors run on a cluster without placement (the default on one machine), and torch reads it
at import: left alone, each engine and trainer would compute on one core whatever
`cluster.actor_num_threads: null` promises ("all cores of the machine").
"""

from __future__ import annotations

import os


def machine_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def actor_threads(configured: int | None, sharers: int = 1) -> int:
    """`configured`, or the machine's cores split evenly among `sharers` processes that
    compute at the same time on it (a CPU train group's ranks on one node); at least 1."""
    if configured:
        return configured
    return max(1, machine_cores() // max(1, sharers))
