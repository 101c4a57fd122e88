"""The run configs the tests build: `arithmetic_config`, a real run on the arithmetic data
(the `make_config` fixture of tests/conftest.py wraps it), and `small_config`, a config that
is only read (mock backends, a prompt file that need not exist)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from flows.config.loader import apply_overrides, config_from_dict
from flows.config.run import RollflowConfig


def arithmetic_config(
    *,
    run_name: str,
    runs_root: str,
    data: dict[str, str],
    model_dir: str,
    ray_address: str,
    backend: str = "mock",
    overrides: list[str] | None = None,
) -> RollflowConfig:
    """Two-digit addition with small steps; `backend` picks mock or embedded+torch."""
    trainer = "mock" if backend == "mock" else "torch"
    raw: dict[str, Any] = {
        "cluster": {"address": ray_address, "namespace": "rollflow-tests", "actor_num_threads": 1},
        "data": {"prompt_data": data["train"], "seed": 3},
        "rollout": {
            "num_rollout": 2, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
            "max_response_len": 4, "rm_type": "exact_match",
        },
        "engine": {"backend": backend, "model_path": model_dir},
        "train": {"backend": trainer, "model_path": model_dir, "lr": 1e-4},
        "storage": {"uri": runs_root, "run_name": run_name},
        "eval": {"before_train": False},
        # no curve PNGs (matplotlib's import and two plots cost a driver about a CPU second;
        # the tests of the curves turn them on)
        "logging": {"progress": False, "plot": False},
    }
    return config_from_dict(apply_overrides(raw, overrides or []))


def config_maker(
    runs_root: Any, data: dict[str, str], model_dir: str, ray_address: str, *base: str,
    backend: str = "embedded",
) -> Callable[..., RollflowConfig]:
    """`make(name, *extra)`: the arithmetic config of a fresh run `name-xxxxxx` under
    `runs_root`, with `base` overrides then `extra` (a module's runs that share settings)."""
    def make(name: str, *extra: str) -> RollflowConfig:
        return arithmetic_config(
            run_name=f"{name}-{uuid.uuid4().hex[:6]}", runs_root=str(runs_root), data=data,
            model_dir=model_dir, ray_address=ray_address, backend=backend,
            overrides=[*base, *extra],
        )

    return make


SMALL = {
    "data": {"prompt_data": "x.jsonl"},
    "rollout": {"num_rollout": 4, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
    "train": {"backend": "mock"},
    "engine": {"backend": "mock"},
}


def small_config(*overrides: str) -> RollflowConfig:
    """Four steps of one prompt x 2 samples, mock engine and trainer; `--set`-style overrides."""
    return config_from_dict(apply_overrides(SMALL, list(overrides)))
