"""The settings one train step learned under, so a rebuilt trainer can replay it under them.

A run's config may change between reruns (a longer `rollout.num_rollout` stretches the
default LR schedule, a new `train.lr` or loss changes the updates). Steps committed before
the change were trained under the old settings; a trainer rebuilt from a checkpoint plus a
replay of the batches after it must replay each of those steps under its own settings, or
the rebuilt weights differ from the ones the run had. The driver stores each distinct
settings once (`RunLayout.save_train_settings`) and names them in each step's train record.

Some settings are fixed when a backend is built (the model, its parts, the seed): a replay
keeps the trainer's own for those and reports each one that differs (`settings_for_replay`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from engines.config.algorithm import AlgorithmConfig
from engines.config.run import RunConfig
from engines.config.train import TrainConfig

FIXED_AT_BUILD: frozenset[str] = frozenset({
    "backend", "tensor_parallel", "pipeline_parallel", "expert_parallel", "model_path", "load",
    "critic_model_path", "seed", "dtype", "device", "lora", "strategy", "context_parallel",
})
"""`train.*` keys every backend reads only when it is built (megatron adds its optimizer's:
`clip_grad`, `weight_decay`, `adam_betas`). The seed only matters to a trainer that starts
from the initial model: a checkpoint restores the random state."""


@dataclass(frozen=True)
class StepSettings:
    """What a train step's update depends on beyond its batch and the weights."""

    train: TrainConfig
    algorithm: AlgorithmConfig
    temperature: float
    reward_key: str | None

    @classmethod
    def of(cls, cfg: RunConfig) -> StepSettings:
        return cls(cfg.train, cfg.algorithm, cfg.rollout.temperature, cfg.rollout.reward_key)

    def to_json(self) -> dict[str, Any]:
        return {
            "train": self.train.model_dump(mode="json"),
            "algorithm": self.algorithm.model_dump(mode="json"),
            "temperature": self.temperature,
            "reward_key": self.reward_key,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepSettings:
        return cls(
            TrainConfig.model_validate(data["train"]),
            AlgorithmConfig.model_validate(data["algorithm"]),
            float(data["temperature"]),
            data.get("reward_key"),
        )

    def digest(self) -> str:
        return settings_digest(self.to_json())


def settings_digest(settings_json: dict[str, Any]) -> str:
    """A short content hash: the name the settings are stored under."""
    text = json.dumps(settings_json, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def parts_needed(algo: AlgorithmConfig) -> dict[str, str | None]:
    """The models besides the policy that training under `algo` needs, built with the
    backend: a frozen reference, a critic, a teacher (by its path)."""
    parts: dict[str, str | None] = {}
    if algo.uses_reference:
        parts["reference"] = None
    if algo.uses_critic:
        parts["critic"] = None
    if algo.use_opd:
        parts["teacher"] = algo.opd_teacher_path
    return parts


def settings_for_replay(
    recorded: StepSettings, current: StepSettings, fixed: frozenset[str] = FIXED_AT_BUILD
) -> tuple[StepSettings, list[str]]:
    """The settings to replay a step recorded under `recorded` with a trainer built for
    `current`, and what of `recorded` that trainer cannot honour (`key: recorded -> kept`).

    The `fixed` train keys are the trainer's own. The recorded algorithm is used unless it
    needs a model the trainer was not built with; then the current one is."""
    lost = []
    kept: dict[str, Any] = {}
    for key in sorted(fixed):
        old, now = getattr(recorded.train, key), getattr(current.train, key)
        if old != now:
            lost.append(f"train.{key}: {_shown(old)} -> {_shown(now)}")
        kept[key] = now
    train = recorded.train.model_copy(update=kept)
    algorithm = recorded.algorithm
    have = parts_needed(current.algorithm)
    missing = [p for p, path in parts_needed(algorithm).items() if p not in have or have[p] != path]
    if missing:
        lost.append(
            f"algorithm: needs a {' and a '.join(missing)} model this trainer was not built "
            "with, so the current algorithm section is used"
        )
        algorithm = current.algorithm
    return StepSettings(train, algorithm, recorded.temperature, recorded.reward_key), lost


def settings_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key: old -> new` for each setting that differs between two `to_json()` dicts
    (`train.lr`, `algorithm.eps_clip`, `temperature`)."""
    def flat(data: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in data.items():
            if isinstance(value, dict) and key in ("train", "algorithm"):
                out.update({f"{key}.{k}": v for k, v in value.items()})
            else:
                out[key] = value
        return out

    a, b = flat(old), flat(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted({*a, *b}) if a.get(k) != b.get(k)]


def _shown(value: Any) -> str:
    return repr(value.model_dump(mode="json") if hasattr(value, "model_dump") else value)
