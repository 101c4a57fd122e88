"""Drivers started together with no Ray head running start one head between them, and a
driver starts the head beside its Prefect server (`head_starting`)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from engines.cluster import head
from engines.config.cluster import ClusterConfig


@pytest.fixture
def fake_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """`start_local_head` replaced by one that takes 0.3 s and records each start."""
    state_file = tmp_path / "cluster.json"
    started: list[str] = []

    def start(num_cpus: int | None, num_gpus: int | None) -> str:
        time.sleep(0.3)  # `ray start` takes seconds: long enough for another driver
        address = f"127.0.0.1:{6000 + len(started)}"
        started.append(address)
        state_file.write_text(json.dumps({"address": address}))
        return address

    monkeypatch.setattr(head, "STATE_FILE", state_file)
    monkeypatch.setattr(head, "start_local_head", start)
    monkeypatch.setattr(head, "_alive", lambda address: address in started)
    for check in ("check_environment", "check_head_usable", "check_auth"):
        monkeypatch.setattr(head, check, lambda state: None)
    return started


def test_drivers_started_together_start_one_head(fake_head: list[str]) -> None:
    addresses: list[str | None] = []
    drivers = [threading.Thread(target=lambda: addresses.append(head.cluster_address(ClusterConfig())))
               for _ in range(3)]
    for d in drivers:
        d.start()
    for d in drivers:
        d.join()
    assert len(fake_head) == 1
    assert addresses == fake_head * 3


def test_the_head_starts_while_the_driver_starts_its_prefect_server(fake_head: list[str]) -> None:
    with head.head_starting(ClusterConfig()):
        deadline = time.monotonic() + 10
        while not fake_head and time.monotonic() < deadline:  # (the Prefect server's start)
            time.sleep(0.05)
        assert fake_head, "no head started while the body ran"
        assert head.cluster_address(ClusterConfig()) == fake_head[0]  # the driver's connect
    assert len(fake_head) == 1


def test_a_driver_with_a_head_running_or_an_address_starts_nothing(fake_head: list[str]) -> None:
    with head.head_starting(ClusterConfig(address="10.0.0.1:6379")):
        time.sleep(0.5)
    assert fake_head == []
    address = head.cluster_address(ClusterConfig())
    with head.head_starting(ClusterConfig()):
        time.sleep(0.5)
    assert fake_head == [address]


def test_a_failed_start_in_the_background_is_reported_by_the_drivers_connect(
    monkeypatch: pytest.MonkeyPatch, fake_head: list[str]
) -> None:
    tries: list[float] = []

    def broken(num_cpus: int | None, num_gpus: int | None) -> str:
        tries.append(time.monotonic())
        raise RuntimeError("ray start failed")

    monkeypatch.setattr(head, "start_local_head", broken)
    with head.head_starting(ClusterConfig()):
        deadline = time.monotonic() + 10
        while not tries and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="ray start failed"):
            head.cluster_address(ClusterConfig())
    assert len(tries) == 2
