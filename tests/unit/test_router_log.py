"""A router's output file has no name in the temporary directory from the start, so a rollout
actor killed with its router running (how runs end their actors) leaves nothing behind, and
a router that fails to start still shows its last lines in the error."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

from engines.rollout.router import RouterError, RouterProcess


def test_a_router_leaves_no_file_in_the_temporary_directory(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    router = RouterProcess(["http://127.0.0.1:1"])
    assert list(tmp_path.iterdir()) == []
    router.shutdown()


def test_a_router_that_exits_at_start_names_its_last_lines(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    router = RouterProcess(["http://127.0.0.1:1"], startup_timeout_s=20)
    monkeypatch.setattr(router, "_command", lambda: [
        sys.executable, "-c", "print('first'); print('unknown argument --policy'); raise SystemExit(2)"])
    with pytest.raises(RouterError, match="(?s)exited with code 2.*unknown argument --policy"):
        router.start()
    router.shutdown()
    assert list(tmp_path.iterdir()) == []

