"""Benchmarks leave the machine as they found it: a local Ray head one starts is stopped."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engines.cluster.head import cluster_address, stop_local_head
from engines.config.cluster import ClusterConfig


@contextmanager
def stopping_a_new_head(address: str | None = None) -> Iterator[None]:
    """On exit, stop the local Ray head if none was up on entry (and no `address` was given):
    its idle daemons would otherwise run into the next measurement."""
    head_was_up = bool(address or cluster_address(ClusterConfig(), start=False))
    try:
        yield
    finally:
        if not head_was_up:
            import ray

            ray.shutdown()
            stop_local_head()
