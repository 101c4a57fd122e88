"""The local Ray head rollflow starts is closed: without its token, nobody runs code on it.

Ray's listeners bind every interface, so the probe connects over the machine's own
non-loopback address (traffic never leaves the machine). Each client is a subprocess:
Ray reads its auth settings once per process.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import psutil
import pytest

from tests.support.procs import python, rollflow_env

PROBE = ("import os, sys, ray; ray.init(address=sys.argv[1], log_to_driver=False); "
         "print('uid', ray.get(ray.remote(lambda: os.getuid()).remote()))")
# A rollflow driver as the CLI runs one: rollflow imported first (which fixes Ray's auth mode),
# then the local head started on demand, or found, and joined, in the same process.
DRIVER = ("import os; from engines.config.cluster import ClusterConfig; "
          "from engines.cluster.head import connect; import ray; "
          "print(connect(ClusterConfig(num_cpus=1))); "
          "print('uid', ray.get(ray.remote(lambda: os.getuid()).remote()))")


def machine_address() -> str:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not a.address.startswith("127."):
                return str(a.address)
    pytest.skip("no non-loopback IPv4 address on this machine")


def test_a_client_without_the_token_cannot_run_code_on_rollflows_head(fault_matrix):
    home = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))  # short: Ray's socket paths
    env = rollflow_env(home)  # no RAY_AUTH_* at all: rollflow's defaults
    try:
        first = python(DRIVER, env)
        out, err = first.communicate(timeout=180)
        assert first.returncode == 0 and f"uid {os.getuid()}" in out, err
        address = out.splitlines()[0].strip()
        target = f"{machine_address()}:{address.rsplit(':', 1)[1]}"
        token = home / "ray_token"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        no_auth = python(PROBE, rollflow_env(home, RAY_AUTH_MODE="disabled"), target)
        wrong = python(PROBE, rollflow_env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="x" * 64),
                       target)
        again = python(DRIVER, env)  # a second driver finds the head and joins it
        again_out, again_err = again.communicate(timeout=120)
        assert again_out.startswith(address) and f"uid {os.getuid()}" in again_out, again_err
        right = python(PROBE, rollflow_env(home, RAY_AUTH_MODE="token",
                                           RAY_AUTH_TOKEN_PATH=str(token)), target)
        right_out, right_err = right.communicate(timeout=120)
        assert f"uid {os.getuid()}" in right_out, right_err
        for denied in (no_auth, wrong):
            denied_out, _ = denied.communicate(timeout=180)
            assert denied.returncode != 0 and "uid" not in denied_out
    finally:
        stop = python("from engines.cluster.head import stop_local_head; stop_local_head()", env)
        stop.communicate(timeout=60)
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"])
                 if any(str(home) in a for a in p.info["cmdline"] or [])]
    assert leftovers == []  # `cluster down` stopped its own head, and only it
    fault_matrix.add("client without the Ray token, over the machine's address", "connect",
                     "refused (no code runs); with the token: runs", None)
