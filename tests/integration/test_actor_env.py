"""A run's actors get the OpenMP wait settings and the import path rollflow gives them
(`engines/cluster/registry.py`): from the head's own environment where it already has them
(no runtime_env, whose worker start costs a second interpreter), else from a runtime_env, so
a hook next to the user's config still imports. Real actors on the session's Ray head, whose
environment is set as a head rollflow starts (tests/conftest.py)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import uuid
from typing import Any

import ray

from engines.cluster.actors import _named
from engines.cluster.registry import OPENMP_WAIT, ROOT


class EnvReport:
    def report(self) -> dict[str, Any]:
        return {"runtime_env": dict(ray.get_runtime_context().runtime_env),
                "gomp": os.environ.get("GOMP_SPINCOUNT"),
                "path": [os.path.realpath(p) for p in sys.path],
                "hook": importlib.util.find_spec("my_hook") is not None}


def _report(cfg: Any) -> dict[str, Any]:
    actor = _named(EnvReport, f"env-report-{uuid.uuid4().hex[:6]}", cfg)
    try:
        return dict(ray.get(actor.report.remote(), timeout=120))
    finally:
        ray.kill(actor)


def test_actors_of_a_driver_in_rollflows_directory_need_no_runtime_env(make_config, monkeypatch):
    monkeypatch.chdir(ROOT)
    for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(key, raising=False)
    seen = _report(make_config("env"))
    assert seen["runtime_env"] == {}
    assert seen["gomp"] == OPENMP_WAIT["GOMP_SPINCOUNT"] and str(ROOT) in seen["path"]


def test_a_driver_elsewhere_gives_its_actors_its_directory(make_config, tmp_path, monkeypatch):
    (tmp_path / "my_hook.py").write_text("def reward(*a): return 1.0\n")
    monkeypatch.chdir(tmp_path)
    for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(key, raising=False)
    seen = _report(make_config("env"))
    assert seen["runtime_env"]["env_vars"]["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path)
    assert seen["hook"] and seen["gomp"] == OPENMP_WAIT["GOMP_SPINCOUNT"]
    # a driver's own OpenMP setting, which the head's workers lack, goes on too
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    seen = _report(make_config("env"))
    assert seen["gomp"] == "7" and seen["runtime_env"]["env_vars"]["GOMP_SPINCOUNT"] == "7"


def test_the_heads_probe_leaves_no_idle_worker(ray_address, monkeypatch):
    """The task that asks the head what its workers have runs once per head; its worker then
    exits, where an idle one would stay up for the head's life at about 0.5-1.4 CPU-s a
    minute (bench/RESULTS.md, "CI cost")."""
    import time

    import psutil
    from ray.experimental import internal_kv

    from engines.cluster import registry

    ray.init(address=ray_address, ignore_reinit_error=True)
    monkeypatch.setattr(registry, "_head_worker_envs", {})
    internal_kv._internal_kv_del(registry._WORKER_ENV_KEY, namespace=registry._KV_NAMESPACE)
    seen = registry.connected_head_worker_env()
    assert seen is not None and seen["pythonpath"], seen

    def alive() -> bool:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(seen["pid"]).status() != psutil.STATUS_ZOMBIE
        return False

    deadline = time.monotonic() + 60
    while alive() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(), "the probe's worker is still up"
