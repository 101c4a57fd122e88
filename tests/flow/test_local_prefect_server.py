"""A driver without PREFECT_API_URL (the README's main job, `rollflow train` on a laptop) runs
against a local server of rollflow's (flows.servers.prefect_server.local_prefect_api), not Prefect's
ephemeral one: its flow runs are recorded there, the server stops with the driver, and a
driver killed with -9 leaves no server behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support import REPO_ROOT

DRIVER = """
import json, sys, time
from flows.servers.prefect_env import prefect_env_defaults
prefect_env_defaults()
from prefect import flow, task
from prefect.client.orchestration import get_client
from flows.servers.prefect_server import local_prefect_api

@task
def add_one(x): return x + 1

@flow(name="local-server-check")
def check(x): return add_one(x)

with local_prefect_api() as server:
    print(json.dumps({"pid": server.process.pid, "api": server.api_url}), flush=True)
    if sys.argv[1] == "hang":
        time.sleep(600)
    result = check(1)
    with get_client(sync_client=True) as client:
        flows = sorted(client.read_flow(r.flow_id).name for r in client.read_flow_runs())
    print(json.dumps({"result": result, "flows": flows}), flush=True)
"""


@pytest.fixture(scope="module")
def driver_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A user's shell: no Prefect API configured, a Prefect home of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path_factory.mktemp("prefect-home")),
               PYTHONPATH=str(REPO_ROOT))
    return env


def start_driver(mode: str, env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", DRIVER, mode], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.2)
    return False


def test_a_driver_without_an_api_records_its_runs_on_a_local_server(driver_env, tmp_path):
    driver = start_driver("run", driver_env, tmp_path)
    out, err = driver.communicate(timeout=240)
    assert driver.returncode == 0, err[-3000:]
    started, done = (json.loads(line) for line in out.strip().splitlines()[-2:])
    assert started["api"].startswith("http://127.0.0.1:")
    assert done == {"result": 2, "flows": ["local-server-check"]}
    assert gone(started["pid"], within_s=30), "the server outlived its driver"


def test_a_killed_driver_leaves_no_server_behind(driver_env, tmp_path):
    driver = start_driver("hang", driver_env, tmp_path)
    assert driver.stdout is not None
    started = json.loads(driver.stdout.readline())
    server = psutil.Process(started["pid"])
    assert server.cmdline()[1:4] == ["-m", "flows.servers.prefect_app", "local"]
    assert server.is_running()
    driver.send_signal(signal.SIGKILL)
    driver.wait(30)
    assert gone(started["pid"], within_s=30), "the server outlived its killed driver"
