"""Say so when a trainer rebuilt by replay may not reproduce the weights the run trained.

A lost or restarted trainer is rebuilt from the last checkpoint plus a replay of the saved
train batches after it, each step under the settings its train record names
(`engines/train/step_settings.py`), so a rerun that changed the config (the old one is kept
as `configs/<n>.yaml`) still rebuilds the weights the run had. Two cases cannot be exact,
and are warned about here, naming the keys:
- steps of runs from before settings were recorded replay under the current config: when an
  earlier config of the run differs in training keys (a longer `rollout.num_rollout`
  stretches the default LR schedule, a new `train.lr` changes the updates; an extended
  4-rollout run evaluated at version 2 scored 0.672 against 0.66), the weights may differ;
- settings a backend fixes when it is built (model, seed, parts) cannot be switched back.
"""

from __future__ import annotations

import logging
from typing import Any

import yaml

from flows.config.run import RollflowConfig
from storage.run_layout import RunLayout

log = logging.getLogger(__name__)

# What changes a replayed update: the train and algorithm sections, and the run's length
# (the default LR schedule spans all of its optimizer steps).
TRAINING_SECTIONS = ("train", "algorithm")


def _training_view(data: dict[str, Any]) -> dict[str, Any]:
    view = {f"{s}.{k}": v for s in TRAINING_SECTIONS for k, v in (data.get(s) or {}).items()}
    view["rollout.num_rollout"] = (data.get("rollout") or {}).get("num_rollout")
    return view


def changed_training_keys(layout: RunLayout, config: RollflowConfig) -> list[str]:
    """`key: old -> new` for each training setting that differs between `config` and an
    earlier config of the run (`configs/*.yaml`), oldest first."""
    now = _training_view(config.model_dump(mode="json"))
    changes: list[str] = []
    for name in sorted(layout.store.list("configs")):
        old = _training_view(yaml.safe_load(layout.store.read_text("configs", name)) or {})
        for key, value in old.items():
            line = f"{key}: {value!r} -> {now.get(key)!r}"
            if key in now and now[key] != value and line not in changes:
                changes.append(line)
    return changes


def warn_if_replayed_under_changed_config(
    restored: dict[str, Any], layout: RunLayout, config: RollflowConfig
) -> list[str]:
    """Log a warning for each way the trainer's replay (`restored`, from `ensure_version`)
    may not have reproduced the run's weights; returns the lines warned about."""
    lines = list(restored.get("inexact") or [])
    if lines:
        log.warning(
            "the trainer was rebuilt by replaying steps %s, but could not switch to some of "
            "the settings they were trained under, so the rebuilt weights may differ from "
            "the ones the run had: %s", restored.get("replayed"), "; ".join(lines),
        )
    unrecorded = list(restored.get("unrecorded") or [])
    changes = changed_training_keys(layout, config) if unrecorded else []
    if changes:
        log.warning(
            "the trainer was rebuilt by replaying steps %s, which recorded no settings (they "
            "were trained before rollflow recorded them), with the current config, which "
            "differs from an earlier config of this run in %s: if those steps were trained "
            "under the earlier one, the rebuilt weights differ from the ones the run had",
            unrecorded, "; ".join(changes),
        )
    return lines + changes
