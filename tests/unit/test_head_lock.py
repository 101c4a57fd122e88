"""Drivers started together with no Ray head running start one head between them."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from engines.cluster import head
from engines.config.cluster import ClusterConfig


def test_drivers_started_together_start_one_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_file = tmp_path / "cluster.json"
    started: list[str] = []

    def start(num_cpus: int | None, num_gpus: int | None) -> str:
        time.sleep(0.3)  # `ray start` takes seconds: long enough for the other driver
        address = f"127.0.0.1:{6000 + len(started)}"
        started.append(address)
        state_file.write_text(json.dumps({"address": address}))
        return address

    monkeypatch.setattr(head, "STATE_FILE", state_file)
    monkeypatch.setattr(head, "start_local_head", start)
    monkeypatch.setattr(head, "_alive", lambda address: address in started)
    for check in ("check_environment", "check_head_usable", "check_auth"):
        monkeypatch.setattr(head, check, lambda state: None)
    addresses: list[str | None] = []
    drivers = [threading.Thread(target=lambda: addresses.append(head.cluster_address(ClusterConfig())))
               for _ in range(3)]
    for d in drivers:
        d.start()
    for d in drivers:
        d.join()
    assert len(started) == 1
    assert addresses == started * 3
