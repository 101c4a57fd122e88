"""Every local path of a run config made absolute, once, in the driver.

Actors run in Ray worker processes whose working directory is wherever the Ray head was
started, so a relative `data/train.jsonl` or `./runs` would name a different file there than
in the user's shell (one run split across two directories). `resolve_paths` anchors every
path at the directory the command was run from before the config leaves the driver. URIs
(`s3://...`) and environments (`pkg.module:factory`) are left alone, and so are model names
that are not local directories (`Qwen/Qwen2-0.5B` is a Hugging Face hub id, not a path).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from engines.config.rollout import is_environment_uri
from flows.config.run import RollflowConfig

# section -> fields that always name a local file or directory (unless a URI)
FILE_FIELDS: dict[str, tuple[str, ...]] = {
    "data": ("prompt_data",),
    "storage": ("uri",),
    "rollout": ("debug_rollout_data",),
    "logging": ("tensorboard_dir", "wandb_dir"),
    "train": ("checkpoint_staging_dir",),
}
# section -> fields naming a model: a local directory, or else a hub id
MODEL_FIELDS: dict[str, tuple[str, ...]] = {
    "engine": ("model_path",),
    "train": ("model_path", "load", "critic_model_path"),
    "algorithm": ("opd_teacher_path",),
}


def is_uri(path: str) -> bool:
    """A URI (`s3://`, `reasoning_gym://`, ...) or an environment's import string
    (`pkg.module:factory`): nothing to anchor."""
    return "://" in path or is_environment_uri(path)


def absolute_file(path: str, base: Path) -> str:
    """`path` anchored at `base` (`~` expanded); URIs unchanged."""
    if is_uri(path):
        return path
    return os.path.normpath(base / Path(path).expanduser())


def looks_like_hub_id(path: str, base: Path) -> bool:
    """`org/name`: one slash, not starting like a path, and `org` is not a local directory.
    Anything else that is not on disk is a local path with a typo (reported as missing at
    once) rather than a hub lookup that retries for a minute on an offline machine:
    `name`, `runs/x/checkpoints/3`, and `runs/x` where `./runs` exists."""
    org = path.split("/", 1)[0]
    return (path.count("/") == 1 and not path.startswith((".", "~", os.sep))
            and all(path.split("/")) and not (base / org).is_dir())


def absolute_model(path: str, base: Path) -> str:
    """A local model directory made absolute; a hub id (`org/name`, not on disk) unchanged."""
    if is_uri(path):
        return path
    local = base / Path(path).expanduser()
    hub_id = looks_like_hub_id(path, base)
    return path if hub_id and not local.exists() else os.path.normpath(local)


def _resolve_section(
    section: BaseModel, fields: tuple[str, ...], fix: Any, base: Path
) -> BaseModel:
    update = {f: fix(getattr(section, f), base) for f in fields if getattr(section, f)}
    return section.model_copy(update=update)


def resolve_paths(cfg: RollflowConfig, base: str | Path | None = None) -> RollflowConfig:
    """`cfg` with every local path absolute, relative to `base` (default: the current
    directory). Idempotent: an already resolved config comes back equal."""
    root = Path(base) if base is not None else Path.cwd()
    update: dict[str, Any] = {}
    for name, fields in FILE_FIELDS.items():
        update[name] = _resolve_section(getattr(cfg, name), fields, absolute_file, root)
    for name, fields in MODEL_FIELDS.items():  # a section may be in both
        section = update.get(name, getattr(cfg, name))
        update[name] = _resolve_section(section, fields, absolute_model, root)
    datasets = [d.model_copy(update={"path": absolute_file(d.path, root)})
                for d in cfg.eval.datasets]
    update["eval"] = cfg.eval.model_copy(update={"datasets": datasets})
    return cfg.model_copy(update=update)
