"""`engines.process.free_port` hands out ports an outgoing connection can never take.

A port from `bind(0)` lies in the kernel's ephemeral range, the one every outgoing TCP
connection on the machine draws its source port from; between `free_port` returning and the
server binding, a Ray or Prefect client could take it (CI lost a gloo rendezvous to
EADDRINUSE that way). Below the range, only another server can."""

from __future__ import annotations

import socket

import pytest

from engines import process
from engines.process import free_port


def test_ports_lie_below_the_ephemeral_range_and_are_bindable() -> None:
    low = process._ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(process._SERVER_PORTS_LOW <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1, "the same port every time: two servers started together would collide"
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the server range squeezed to one port that is taken, the kernel's choice is used."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        monkeypatch.setattr(process, "_SERVER_PORTS_LOW", taken - 1)
        monkeypatch.setattr(process, "_ephemeral_low", lambda: taken + 1)
        for _ in range(5):
            assert free_port() != taken
