"""A data-parallel train group: N `TrainActor` ranks behind one handle, like slime's
`RayTrainGroup`.

The step tasks talk to the trainer as `ray.get(trainer.<method>.remote(...))`, and pass the
ref of `trainer.weights.remote()` straight on to the engines, so the group's handle offers
the same method surface and returns real `ObjectRef`s:

```
 group.train_step.remote(k) ──> rank 0 .train_step(k) ─┐
                                rank 1 .train_step(k) ─┼─> _gather task ──> ObjectRef
                                ...                    ─┘   (rank 0's result; the first
                                                             rank error, after killing all)
 group.weights.remote()     ──> rank 0 .weights()      ──> ObjectRef (rank 0 only)
```
Every rank runs the collective methods (train, checkpoints, offload); rank 0 alone answers
the rest (its weights and version are everyone's) -- except that `weights` and
`push_weights` are collective too when the backend's weight export is (`collective_export`:
megatron gathers TP shards and PP stages from every rank; rank 0 alone talks to engines), and
`push_weights` is also collective where each rank may send the CUDA IPC handles of its own
GPU (`collective_push`: colocated tensor sync). A failed or killed rank leaves the others
inside a collective that can never finish, so any rank failure kills the whole group; the
next attach (every task reattaches) creates it afresh, and the ranks come back to the run's
weight version through the trainer's own rebuild path (checkpoint + replay).

Creation is two-phase as in slime: rank 0 first, which picks the rendezvous address on its
node, then the other ranks, then all join the process group together (`join_group`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from engines.train.errors import ParallelLayoutError

# Methods every rank must run (they touch the model collectively); the others go to rank 0.
COLLECTIVE = ("train", "train_step", "ensure_version", "save_checkpoint", "offload", "onload")
RANK0 = ("version", "weights", "push_weights", "push_timings", "close_weight_sender",
         "trained_indices", "sends_cuda_ipc")
EXPORT = ("weights", "push_weights")  # collective when the backend's export is
PUSH = ("push_weights", "close_weight_sender")  # collective when every rank sends (its sender)

JOIN_TIMEOUT_S = 900.0  # a join includes loading the model on every rank


class TrainGroupError(RuntimeError):
    """A rank failed; the group was killed so that the next attach rebuilds it."""


def actor_exists(name: str, namespace: str) -> bool:
    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


def kill_group(names: Sequence[str], namespace: str, wait_s: float = 30.0) -> int:
    """Kill the ranks still alive and wait until their names are free; returns how many."""
    killed = 0
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
            killed += 1
        except ValueError:
            pass
    deadline = time.monotonic() + wait_s
    while any(actor_exists(n, namespace) for n in names) and time.monotonic() < deadline:
        time.sleep(0.1)
    return killed


def _gather(refs: list[Any], names: list[str], namespace: str) -> Any:
    """Rank 0's result once every rank succeeded; the first failure kills the group."""
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready)
        except Exception as exc:
            rank = refs.index(ready[0])
            kill_group(names, namespace)
            cause = getattr(exc, "cause", None)
            if isinstance(cause, ParallelLayoutError):  # the user's to fix: say it in one line
                raise cause from None
            raise TrainGroupError(
                f"train rank {rank} of {len(refs)} failed; the group was killed and is "
                f"rebuilt on the next attach: {exc}"
            ) from exc
    return ray.get(refs[0])


_gather_task: Any = ray.remote(num_cpus=0, max_retries=0)(_gather)


class _GroupMethod:
    """`group.<method>`: `.remote(...)` returns one ObjectRef, like an actor method."""

    def __init__(self, group: TrainGroup, method: str, collective: bool) -> None:
        self._group, self._method, self._collective = group, method, collective

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        ranks = self._group.ranks
        if not self._collective:
            return getattr(ranks[0], self._method).remote(*args, **kwargs)
        refs = [getattr(r, self._method).remote(*args, **kwargs) for r in ranks]
        return _gather_task.remote(refs, list(self._group.names), self._group.namespace)


class TrainGroup:
    """The handle of N train ranks; duck-types a `TrainActor` handle for the step tasks."""

    def __init__(
        self, ranks: Sequence[Any], names: Sequence[str], namespace: str,
        collective_export: bool = False, collective_push: bool = False,
    ) -> None:
        self.ranks, self.names, self.namespace = list(ranks), list(names), namespace
        for method in COLLECTIVE + RANK0:
            collective = (method in COLLECTIVE or (collective_export and method in EXPORT)
                          or (collective_push and method in PUSH))
            setattr(self, method, _GroupMethod(self, method, collective))

    def kill(self) -> int:
        return kill_group(self.names, self.namespace)


def get_or_create_group(
    names: Sequence[str], namespace: str, create: Callable[[int, int], Any],
    collective_export: bool = False, collective_push: bool = False,
) -> TrainGroup:
    """Attach to the ranks named `names`, or (re)create all of them.

    `create(rank, world_size)` returns the handle of rank `rank` (a detached actor created
    with `get_if_exists`). All ranks alive: attach without calling them (they may be busy
    training). Some missing: the survivors are killed first, since they belong to a process
    group that lost a member.
    """
    world = len(names)
    alive = [actor_exists(n, namespace) for n in names]
    if all(alive):
        ranks = [ray.get_actor(n, namespace=namespace) for n in names]
        return TrainGroup(ranks, names, namespace, collective_export, collective_push)
    if any(alive):
        kill_group(names, namespace)
    try:
        rank0 = create(0, world)
        addr, port = _get(rank0.master_address.remote(), "rank 0 to start")
        ranks = [rank0] + [create(rank, world) for rank in range(1, world)]
        _get([r.join_group.remote(addr, port) for r in ranks], "all ranks to join")
    except BaseException:
        kill_group(names, namespace)  # never leave ranks half-joined
        raise
    return TrainGroup(ranks, names, namespace, collective_export, collective_push)


def _get(refs: Any, what: str) -> Any:
    try:
        return ray.get(refs, timeout=JOIN_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError as exc:
        raise TrainGroupError(
            f"train group: timed out after {JOIN_TIMEOUT_S:.0f}s waiting for {what} "
            f"(free resources: {ray.available_resources()})"
        ) from exc
