"""bench/ci_cost.py's sampler: a process running before the start counts from the start,
one started later all of its CPU; the sampling process itself is not counted."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.ci_cost import Sampler

BURN = ("import time, sys\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
        "print('burnt', flush=True)\ntime.sleep(float(sys.argv[1]))")


def test_the_sampler_counts_only_what_a_process_used_while_it_ran() -> None:
    before = subprocess.Popen([sys.executable, "-c", BURN, "30"], stdout=subprocess.PIPE)
    try:
        assert before.stdout is not None and before.stdout.readline() == b"burnt\n"
        sampler = Sampler(period_s=0.1).start()
        during = subprocess.Popen([sys.executable, "-c", BURN, "1"], stdout=subprocess.PIPE)
        assert during.stdout is not None and during.stdout.readline() == b"burnt\n"
        during.wait()
        sampler.stop()
    finally:
        before.kill()
        before.wait()
    by_pid = {pid: seen for (pid, _), seen in sampler.seen.items()}
    assert by_pid[during.pid].cpu >= 0.45  # all of its CPU: it started after the sampler
    assert by_pid[before.pid].cpu < 0.2  # its burn was before the start
    assert os.getpid() not in by_pid
