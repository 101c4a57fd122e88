"""How many engines a running training was asked to have (`rollflow engines add|remove RUN`).

The request is a small JSON file in the run directory (`engines.json`), written atomically,
so it outlives the command, the driver and the Ray cluster: the run's next weight push (or
a resumed driver) reads it and grows or shrinks the pool to it. It remembers the config's
`engine.num_engines` it was made under: a run whose config names another count since (a
rerun with an edited config) follows its config, the newer word.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from storage.object_store import ObjectStore

ENGINE_POOL = "engines.json"


@dataclass(frozen=True, slots=True)
class PoolRequest:
    num_engines: int  # the pool size asked for
    configured: int  # `engine.num_engines` of the config it was asked under
    requested_at: float = 0.0

    def target(self, configured: int) -> int:
        """The pool size for a run whose config names `configured` engines."""
        return self.num_engines if configured == self.configured else configured


def read_pool_request(store: ObjectStore) -> PoolRequest | None:
    """The run's request (`store` is the run directory), None if it has none."""
    if not store.exists(ENGINE_POOL):
        return None
    data = store.read_json(ENGINE_POOL)
    return PoolRequest(int(data["num_engines"]), int(data["configured"]),
                       float(data.get("requested_at", 0.0)))


def write_pool_request(store: ObjectStore, num_engines: int, configured: int) -> PoolRequest:
    if num_engines < 1:
        raise ValueError(f"an engine pool needs at least one engine, not {num_engines}")
    request = PoolRequest(num_engines, configured, time.time())
    store.write_json({"num_engines": request.num_engines, "configured": request.configured,
                      "requested_at": request.requested_at}, ENGINE_POOL)
    return request
