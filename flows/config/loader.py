"""YAML + dotted `--set key=value` overrides -> a validated `RollflowConfig`.

Override values are parsed as YAML scalars/lists (`8`, `1e-4`, `true`, `[1, 2]`, `null`), so
`--set rollout.stop='["\\n"]'` works the same as writing it in the file.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from flows.config.paths import resolve_paths
from flows.config.run import ConfigError, RollflowConfig, format_validation_error
from storage.config import StorageConfig
from storage.secrets import register

_SEGMENT = re.compile(r"^([^.\[\]]+)((?:\[\d+\])*)$")


def _key_parts(item: str, key: str) -> list[str | int]:
    """`eval.datasets[0].path` -> ['eval', 'datasets', 0, 'path'] (the form errors name)."""
    parts: list[str | int] = []
    for segment in key.strip().split("."):
        if not segment:
            continue
        match = _SEGMENT.match(segment)
        if match is None:
            raise ConfigError(f"override {item!r}: cannot read the key part {segment!r}")
        parts.append(match.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", match.group(2)))
    if not parts:
        raise ConfigError(f"override {item!r} has an empty key")
    return parts


def parse_override(item: str) -> tuple[list[str | int], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    parts = _key_parts(item, key)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse value {raw!r}: {e}") from e
    return parts, value


def _dotted(parts: list[str | int]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")


def _child(node: Any, part: str | int, path: list[str | int]) -> Any:
    """`node[part]`, made (a section) if missing; a list index must exist or come next."""
    if isinstance(part, int):
        if not isinstance(node, list):
            raise ConfigError(f"{_dotted(path[:-1])} is not a list")
        if part > len(node):
            raise ConfigError(f"{_dotted(path)}: the list has {len(node)} item(s)")
        if part == len(node):
            node.append({})
        return node[part]
    if not isinstance(node, dict):
        raise ConfigError(f"{_dotted(path[:-1])} is not a section")
    return node.setdefault(part, {})


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of `data` with each `a.b.c=value` applied (the input is left untouched); a key
    may index a list, `eval.datasets[0].path=x` (the next index appends an item)."""
    data = copy.deepcopy(data)
    for item in overrides:
        parts, value = parse_override(item)
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            node = _child(node, part, parts[: i + 1])
        last = parts[-1]
        _child(node, last, parts)  # checks the container (and makes room in a list)
        node[last] = value
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
    """The storage section a command on existing runs (`replay`, `runs`) reads them with,
    before a run's config is known: `--root`, `--endpoint-url`, and the `--set storage.*`
    overrides (credentials: `storage_options`, `credentials_block`)."""
    section = dict(apply_overrides({}, overrides).get("storage") or {})
    section.update(uri=root, **({"endpoint_url": endpoint_url} if endpoint_url else {}))
    section.pop("run_name", None)
    try:
        return StorageConfig(**section)
    except ValidationError as e:
        raise ConfigError(f"--set storage.*:\n{format_validation_error(e)}") from None
