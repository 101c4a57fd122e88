"""Colocated runs (`cluster.colocate`): engines and trainer share the devices, so each phase
frees the other's memory, as slime does with offload/onload and SGLang's memory saver.

```
 generate:   trainer.offload()    engines /resume_memory_occupation
 train:      engines /release_memory_occupation    trainer.onload()
 broadcast:  engines /resume_memory_occupation (weights must be resident to be updated)
```
The engine side goes through the SGLang HTTP API, so real SGLang servers work the same way.
Every call is idempotent, so a retried task can repeat it safely.
"""

from __future__ import annotations

import httpx
import ray

from engines.cluster.actors import RunActors
from engines.process import tls_verify

MEMORY_TAGS = ["weights", "kv_cache"]


def _engines_memory(actors: RunActors, action: str) -> None:
    urls = ray.get([e.url.remote() for e in actors.engines])
    for url in urls:
        response = httpx.post(f"{url}/{action}_memory_occupation", json={"tags": MEMORY_TAGS},
                              timeout=600.0, verify=tls_verify(url))
        response.raise_for_status()


def enter_rollout_phase(actors: RunActors) -> None:
    ray.get(actors.trainer.offload.remote())
    _engines_memory(actors, "resume")


def enter_train_phase(actors: RunActors) -> None:
    _engines_memory(actors, "release")
    ray.get(actors.trainer.onload.remote())


def resume_engines(actors: RunActors) -> None:
    _engines_memory(actors, "resume")
