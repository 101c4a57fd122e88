"""The on-demand local Ray head does not depend on the directory a run was started from:
started from a directory that is then deleted, it still starts workers (that load torch) for
a run started from another directory; and a head whose processes run in a deleted directory
is named as broken, in one line."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engines.cluster.head import BrokenHead, check_head_usable, cluster_address, stop_local_head
from engines.config.cluster import ClusterConfig
from engines.process import HOME

# A new worker of the head: imports torch (what failed in a deleted directory) and says
# where it runs.
WORKER = """
import os, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
@ray.remote
def where():
    import torch
    return os.getcwd()
print(ray.get(where.remote(), timeout=120))
"""


def test_a_head_started_from_a_deleted_directory_serves_runs_from_another(tmp_path, monkeypatch):
    started_in, later_in = tmp_path / "checkout", tmp_path / "elsewhere"
    started_in.mkdir()
    later_in.mkdir()
    monkeypatch.chdir(started_in)
    address = cluster_address(ClusterConfig(num_cpus=1, num_gpus=0))
    try:
        shutil.rmtree(started_in)
        monkeypatch.chdir(later_in)
        assert cluster_address(ClusterConfig()) == address  # reused, not named broken
        out = subprocess.run([sys.executable, "-c", WORKER, address], capture_output=True,
                             text=True, timeout=180, cwd=later_in)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == str(HOME / "ray")
        # no log monitor (engines/cluster/head.py): no rollflow driver reads worker logs
        monitors = [p for p in psutil.process_iter(["cmdline"])
                    if any("log_monitor.py" in a for a in p.info["cmdline"] or [])
                    and any(str(HOME / "ray") in a for a in p.info["cmdline"] or [])]
        assert monitors == []
    finally:
        stop_local_head()


def test_a_head_running_in_a_deleted_directory_is_named_broken(tmp_path):
    gone, marker = tmp_path / "gone", str(tmp_path / "head-temp-dir")
    gone.mkdir()
    # stands in for a head's process: its session dir on the command line, its cwd `gone`
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker],
                            cwd=gone)
    try:
        time.sleep(0.2)
        state = {"address": "127.0.0.1:6390", "temp_dir": marker}
        check_head_usable(state)  # its directory still there: usable
        shutil.rmtree(gone)
        with pytest.raises(BrokenHead) as broken:
            check_head_usable(state)
        message = str(broken.value)
        assert "\n" not in message
        assert message == (
            f"the local Ray head at 127.0.0.1:6390 is broken: it runs in {gone}, which was "
            "deleted, so no worker can start there; stop it with `rollflow cluster down` (the "
            "next run starts a new one)")
    finally:
        proc.kill()
        proc.wait()
    assert Path(marker).exists() is False
