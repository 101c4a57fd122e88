"""The CPU meter counts a child process's CPU under its role."""

from __future__ import annotations

import subprocess
import sys
import time

from bench.cpu_meter import CpuMeter


def test_a_child_burning_cpu_is_counted_under_its_role() -> None:
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"
    with CpuMeter(period=0.05, discover_every=0.05) as meter:
        start = time.time()
        child = subprocess.Popen([sys.executable, "-c", burn])
        # the meter follows the child from its first discovery, a poll after it starts
        while child.poll() is None:
            time.sleep(0.01)
        end = time.time()
    roles = meter.by_role(start, end)
    child_role = meter.roles[child.pid]
    assert roles[child_role] >= 0.3, roles  # most of its 0.6 s (its first poll may be late)
    # the total holds the child; the driver's share (its CPU less the meter's own, two series
    # read at different moments) can come out a few ms below zero
    assert meter.at(end) - meter.at(start) >= roles[child_role] - 0.02
    assert meter.own > 0.0
