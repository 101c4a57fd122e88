"""YAML + dotted `--set key=value` overrides -> a validated `RollflowConfig`.

Override values are parsed as YAML scalars/lists (`8`, `1e-4`, `true`, `[1, 2]`, `null`), so
`--set rollout.stop='["\\n"]'` works the same as writing it in the file.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flows.config import ConfigError, RollflowConfig, format_validation_error
from flows.config_paths import resolve_paths
from storage.config import StorageConfig
from storage.secrets import register


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {e}") from e
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of `data` with each `a.b.c=value` applied (the input is left untouched)."""
    data = copy.deepcopy(data)
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(parts[: i + 1])} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def config_from_dict(data: dict[str, Any], base: str | Path | None = None) -> RollflowConfig:
    """Validate `data`, then make its local paths absolute relative to `base` (default: the
    current directory, where the user ran the command)."""
    try:
        config = RollflowConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None
    register(config.secret_values())  # this process's logs never show them
    return resolve_paths(config, base)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RollflowConfig:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"--config {path}: {e.strerror}") from None
        try:
            loaded = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        data = loaded
    return config_from_dict(apply_overrides(data, overrides or []))


def dump_config(config: RollflowConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def cli_storage(root: str, endpoint_url: str | None, overrides: list[str]) -> StorageConfig:
    """The storage section a command on an existing run (`replay`) reads it with, before
    that run's config is known: `--root`, `--endpoint-url`, and the `--set storage.*`
    overrides (credentials: `storage_options`, `credentials_block`)."""
    section = dict(apply_overrides({}, overrides).get("storage") or {})
    section.update(uri=root, **({"endpoint_url": endpoint_url} if endpoint_url else {}))
    section.pop("run_name", None)
    try:
        return StorageConfig(**section)
    except ValidationError as e:
        raise ConfigError(f"--set storage.*:\n{format_validation_error(e)}") from None
