"""The local Ray head rollflow starts on demand: it offers the machine's GPUs (none here) and
runs Ray's dashboard on 127.0.0.1, so Ray's state API (`ray list actors`) works with the
head's token, and `rollflow cluster status` prints where it is.

Each client is a subprocess with its own ROLLFLOW_HOME: Ray reads its auth settings once per
process, and the head must be this test's own (it is stopped at the end, and only it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from tests.flow.test_cluster_auth import python, rollflow_env

# A rollflow driver that starts the head and leaves a named detached actor on it.
DRIVER = ("from engines.cluster.config import ClusterConfig; "
          "from engines.cluster.head import connect; import ray; "
          "print(connect(ClusterConfig(num_cpus=1, namespace='rf-head-test'))); "
          "ray.remote(num_cpus=0)(type('Probe', (), {'ping': lambda self: 1}))"
          ".options(name='probe', lifetime='detached').remote()")
STATE = ("import sys; from ray.util.state import list_actors; "
         "print(sorted(a.name for a in list_actors(address=sys.argv[1])))")


def cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_local_head_has_the_machines_gpus_and_a_dashboard_with_the_state_api():
    home = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))  # short: Ray's socket paths
    env = rollflow_env(home)
    try:
        first = python(DRIVER, env)
        out, err = first.communicate(timeout=180)
        assert first.returncode == 0, err
        deadline = time.monotonic() + 180  # a loaded machine can start the dashboard late
        while True:
            status = json.loads(cli(env, "cluster", "status", "--namespace", "rf-head-test",
                                    "--json"))
            if status["dashboard"] or time.monotonic() > deadline:
                break
            time.sleep(5)
        assert status["alive"] and status["resources"]["GPU"] == torch.cuda.device_count()
        url = status["dashboard"]
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url), url
        text = cli(env, "cluster", "status", "--namespace", "rf-head-test")
        assert f"dashboard {url}" in text and "ray list actors" in text

        token = rollflow_env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(home / "ray_token"))
        state = python(STATE, token, url)
        state_out, state_err = state.communicate(timeout=120)
        assert state.returncode == 0 and "'probe'" in state_out, state_err
        denied = python(STATE, rollflow_env(home, RAY_AUTH_MODE="disabled"), url)
        denied_out, denied_err = denied.communicate(timeout=120)
        assert denied.returncode != 0 and "probe" not in denied_out
        assert "Authentication" in denied_err
    finally:
        cli(env, "cluster", "down")
    assert head_processes(home) == []


def head_processes(home: Path) -> list[str]:
    """Processes naming `home` on their command line or holding a file under it (Ray's
    agents rename their process; its client server's logs are its only trace of `home`)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "name"]):
        try:
            files = [f.path for f in proc.open_files()]
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            files = []
        if any(str(home) in a for a in [*(proc.info["cmdline"] or []), *files]):
            found.append(f"{proc.pid} {proc.info['name']}")
    return found
