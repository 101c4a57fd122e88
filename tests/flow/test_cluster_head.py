"""The local Ray head rollflow starts on demand: it offers the machine's GPUs (none here), runs
its actors at the driver's priority and runs Ray's dashboard on 127.0.0.1, so Ray's state API (`ray list actors`) works with the
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

from tests.support.procs import python, rollflow_env

# A rollflow driver that starts the head and leaves a named detached actor on it.
# The probe says the niceness it runs at: Ray's default (15) starved every actor beside any
# program at normal priority.
DRIVER = ("from engines.config.cluster import ClusterConfig; "
          "from engines.cluster.head import connect; import os, ray; "
          "print(connect(ClusterConfig(num_cpus=1, namespace='rf-head-test'))); "
          "probe = ray.remote(num_cpus=0)(type('Probe', (), {'nice': lambda self: os.nice(0)}))"
          ".options(name='probe', lifetime='detached').remote(); "
          "print('niceness', os.nice(0), ray.get(probe.nice.remote()))")
STATE = ("import sys; from ray.util.state import list_actors; "
         "print(sorted(a.name for a in list_actors(address=sys.argv[1])))")


def cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, text=True,
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_local_head_has_the_machines_gpus_and_a_dashboard_with_the_state_api():
    home = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))  # short: Ray's socket paths
    env = rollflow_env(home, ROLLFLOW_RAY_DASHBOARD="1")  # the tests' heads have none
    try:
        first = python(DRIVER, env)
        out, err = first.communicate(timeout=180)
        assert first.returncode == 0, err
        driver_nice, actor_nice = re.findall(r"niceness (\d+) (\d+)", out)[0]
        assert actor_nice == driver_nice, f"actor at nice {actor_nice}, driver at {driver_nice}"
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
        cli(env, "cluster", "down", "--force")
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


CONNECT = ("from engines.config.cluster import ClusterConfig; "
           "from engines.cluster.head import connect, stop_local_head; import ray, sys; "
           "connect(ClusterConfig(num_cpus=1, namespace='rf-down-test')); ")
# a driver left connected while the head goes down (a notebook, another run)
WAITER = CONNECT + "print('ready', flush=True); sys.stdin.read()"
# a driver that stops the head it used (bench.orchestration does)
STOPPER = CONNECT + "ray.shutdown(); print(stop_local_head(), 'and still running')"


def test_down_stops_the_heads_processes_but_no_driver():
    """Drivers keep their logs under the head's temp dir, as its agents do: `cluster down`
    must not take them (or the process calling it) for the head's."""
    home = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))
    env = rollflow_env(home)
    waiter = subprocess.Popen([sys.executable, "-c", WAITER], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    try:
        assert waiter.stdout is not None and waiter.stdout.readline().strip() == "ready"
        stopper = python(STOPPER, env)
        out, err = stopper.communicate(timeout=180)
        assert stopper.returncode == 0 and "True and still running" in out, err
        assert waiter.poll() is None  # the other driver is still alive
    finally:
        waiter.kill()
        waiter.wait(timeout=30)
        cli(env, "cluster", "down", "--force")
    assert head_processes(home) == []
