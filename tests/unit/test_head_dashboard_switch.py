"""`ROLLFLOW_RAY_DASHBOARD=0` starts a head without Ray's dashboard (the tests' heads: about
19 CPU-s a minute each saved); unset, a head gets one wherever `ray[default]` is installed."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from engines.cluster import head


def head_command(switch: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The `ray start` command `start_local_head` runs with the switch set to `switch`."""
    commands: list[list[str]] = []

    def run(cmd: list[str], **kwargs: Any) -> None:
        commands.append(cmd)

    monkeypatch.setattr(head, "HOME", tmp_path)
    monkeypatch.setattr(head, "STATE_FILE", tmp_path / "cluster.json")
    monkeypatch.setattr(head.subprocess, "run", run)
    if switch is None:
        monkeypatch.delenv(head.DASHBOARD_SWITCH, raising=False)
    else:
        monkeypatch.setenv(head.DASHBOARD_SWITCH, switch)
    head.start_local_head(num_cpus=2, num_gpus=0)
    (cmd,) = commands
    return cmd


@pytest.mark.parametrize("switch", ["0", "false", "off"])
def test_the_switch_starts_a_head_without_a_dashboard(switch: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = head_command(switch, tmp_path, monkeypatch)
    assert "--include-dashboard=false" in cmd
    assert not any(arg.startswith("--dashboard-port") for arg in cmd)


def test_without_the_switch_a_head_gets_its_dashboard(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    if not all(importlib.util.find_spec(n) for n in ("aiohttp", "prometheus_client")):
        pytest.skip("ray[default] is not installed")
    for switch in (None, "1"):
        cmd = head_command(switch, tmp_path, monkeypatch)
        assert "--include-dashboard=false" not in cmd
        assert any(arg.startswith("--dashboard-port=") for arg in cmd)
