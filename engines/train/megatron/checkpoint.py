"""Megatron checkpoints: one `dist_checkpointing` directory per trained part (model +
distributed optimizer), beside an HF export of the policy.

    dist_ckpt/, critic_dist_ckpt/ (ppo)   sharded model + optimizer state, every rank writes
    config.json, model.safetensors        the policy in HF format (rank 0)
    rng.pt                                CPU RNG and the step's shuffle generator
    meta.json                             version, backend, per part: Adam step, LR step
    MANIFEST.json                         written last (checkpoint_io)

The parts live in separate directories because a distributed optimizer's sharded keys do
not carry its model's prefix: two in one directory would collide.
"""

from __future__ import annotations

import json
import os
import queue
from typing import Any

import torch
from torch import Tensor

from engines.train.errors import ParallelLayoutError

META_FILE = "meta.json"
RNG_FILE = "rng.pt"
PART_DIRS = {"actor": "dist_ckpt", "critic": "critic_dist_ckpt"}
# megatron 0.19's default optimizer layout (fully_sharded_model_space) emits flattened-range
# ShardedTensors that its own validator then rejects; dp_reshardable saves cleanly.
_OPTIM_META = {"distrib_optim_sharding_type": "dp_reshardable"}


def _sharded_state(model: Any, optimizer: Any, loading: bool) -> dict[str, Any]:
    model_sd = model.module.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=loading,
                                                      metadata=_OPTIM_META)}


def _write_results_in_process() -> None:
    """megatron's file writer hands back its write results through a queue it makes once
    per process: a `multiprocessing` Manager of the spawn context, i.e. a new interpreter
    that re-imports the process's main module (in a Ray actor, Ray's worker) and then serves
    the queue for the rank's lifetime. Starting it made a rank's first save many times
    slower than the save itself (bench/RESULTS.md, "GPU end to end").
    `dist_checkpointing.save` writes synchronously, in this process, so a thread queue
    carries the same results; megatron's async save (a separate writer process), which
    needs the Manager, is not used here. A queue megatron already made is kept."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", "absent") is None:
        filesystem_async._results_queue = queue.Queue()


def save_part(model: Any, optimizer: Any, path: str) -> None:
    """Collective: every rank writes its shards of `model` (DDP) and `optimizer` into `path`,
    the same path on every rank (`checkpoint_staging`), made on each rank's own disk."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    dist.barrier()
    _write_results_in_process()
    dist_checkpointing.save(_sharded_state(model, optimizer, loading=False), path)


def load_part(model: Any, optimizer: Any, path: str, step: float | None) -> None:
    """Collective: restore what `save_part` wrote, and the Adam step count (`set_adam_step`)."""
    from megatron.core import dist_checkpointing

    # Without apex/TE the optimizer's state_dict() needs Adam state to exist: a fresh one
    # takes megatron's zero-gradient dummy step; the load overwrites it (and the weights).
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()
    state = dist_checkpointing.load(_sharded_state(model, optimizer, loading=True), path)
    model.module.load_state_dict(state["model"])
    with torch.no_grad():  # fp32 runs: the optimizer's params are the model's leaves
        optimizer.load_state_dict(state["optimizer"])
    if step is not None:
        set_adam_step(optimizer, step)


LAYOUT_KEYS = ("tensor_parallel", "pipeline_parallel", "expert_parallel", "data_parallel")


def check_layout(local_dir: str, saved: dict[str, int] | None, wanted: dict[str, int],
                 version: int) -> None:
    """Refuse, before anything is loaded, a checkpoint whose parallel layout differs from
    the run's (checkpoints from before layouts were recorded are let through)."""
    if saved is None or all(saved.get(k) == wanted.get(k) for k in LAYOUT_KEYS):
        return

    def show(layout: dict[str, int]) -> str:
        return " ".join(f"{k.split('_')[0][0].upper()}P={layout.get(k)}" for k in LAYOUT_KEYS)

    raise ParallelLayoutError(
        f"checkpoint {local_dir} (weight version {version}) was saved by a megatron group of "
        f"{show(saved)}; this run is {show(wanted)}, and megatron's distributed optimizer "
        "state does not reshard: resume with the saved train.tensor_parallel / "
        "pipeline_parallel / expert_parallel and GPU count, or start a new run from its "
        f"weights with train.model_path set to the run's checkpoints/{version - 1:06d} "
        "directory (an HF model; the optimizer starts afresh)")


def write_meta(local_dir: str, meta: dict[str, Any]) -> None:
    with open(os.path.join(local_dir, META_FILE), "w") as f:
        json.dump({**meta, "backend": "megatron"}, f)


def read_meta(local_dir: str) -> dict[str, Any]:
    with open(os.path.join(local_dir, META_FILE)) as f:
        meta: dict[str, Any] = json.load(f)
    return meta


def save_rng(local_dir: str, shuffle: torch.Generator) -> None:
    torch.save({"torch": torch.get_rng_state(), "shuffle": shuffle.get_state()},
               os.path.join(local_dir, RNG_FILE))


def load_rng(local_dir: str, shuffle: torch.Generator) -> None:
    rng = torch.load(os.path.join(local_dir, RNG_FILE), weights_only=True)
    torch.set_rng_state(rng["torch"])
    shuffle.set_state(rng["shuffle"])


def _inner_states(optimizer: Any) -> list[dict[str, Any]]:
    """The per-parameter state dicts of the torch optimizers under megatron's wrappers."""
    return [state for opt in getattr(optimizer, "chained_optimizers", [optimizer])
            for state in opt.optimizer.state.values()]


def adam_step(optimizer: Any) -> float | None:
    """torch Adam's step count (the same for every parameter), None before the first step
    or where the step lives in param groups (apex / TE FusedAdam)."""
    steps = {float(s["step"]) for s in _inner_states(optimizer) if isinstance(s.get("step"), Tensor)}
    if len(steps) > 1:
        raise RuntimeError(f"Adam step counts differ across parameters: {sorted(steps)}")
    return steps.pop() if steps else None


def set_adam_step(optimizer: Any, step: float) -> None:
    """Give every parameter its own Adam `step` tensor holding `step`.

    Without apex/TE, megatron's dist-checkpoint load gets this wrong twice: the `dp_reshardable`
    param state treats `step` as local (so the load copies back the dummy-init step, 1), and
    `DistributedOptimizer.load_state_dict` puts *one* tensor in every parameter's state, which
    torch Adam's in-place `step += 1` then advances once per parameter per update. Either way
    the bias correction after a resume is wrong.
    """
    for state in _inner_states(optimizer):
        if isinstance(state.get("step"), Tensor):
            state["step"] = torch.full_like(state["step"], step)
