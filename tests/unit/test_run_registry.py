"""Actor names carry what shaped the actors; heads belong to one environment."""

from __future__ import annotations

import sys

import pytest

from engines.cluster.head import ClusterMismatch, check_environment, environment
from engines.cluster.registry import (
    OPENMP_WAIT,
    RunActor,
    actor_name,
    actor_runtime_env,
    config_digest,
    run_key,
    section_digests,
)
from flows.config.loader import config_from_dict


def _cfg(*overrides: tuple[str, str, object]):
    raw = {
        "data": {"prompt_data": "/d/train.jsonl"},
        "rollout": {"num_rollout": 3, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "train": {"model_path": "/m"},
        "storage": {"uri": "/runs", "run_name": "exp-1"},
    }
    for section, key, value in overrides:
        raw.setdefault(section, {})[key] = value
    return config_from_dict(raw)


def test_driver_only_fields_keep_the_actors():
    base = config_digest(_cfg())
    assert config_digest(_cfg(("rollout", "num_rollout", 30))) == base  # extend a run
    assert config_digest(_cfg(("logging", "progress", False))) == base
    assert config_digest(_cfg(("cluster", "keep_actors", True))) == base
    assert config_digest(_cfg(("eval", "eval_interval", 5))) == base


@pytest.mark.parametrize("section, key, value", [
    ("data", "prompt_data", "/d/fixed.jsonl"),
    ("rollout", "custom_rm_path", "myreward:score"),
    ("train", "lr", 1e-3),
    ("storage", "storage_options", {"secret": "new"}),  # redacted in dumps, still counted
])
def test_what_actors_read_changes_the_digest(section, key, value):
    before, after = section_digests(_cfg()), section_digests(_cfg((section, key, value)))
    assert before[section] != after[section]
    assert [s for s in before if before[s] != after[s]] == [section]


def test_names_parse_back_into_run_role_and_suffix():
    cfg = _cfg()
    parsed = RunActor.parse(actor_name(cfg, "trainer-rank1"))
    assert parsed is not None
    assert (parsed.run_name, parsed.role) == ("exp-1", "trainer-rank1")
    assert parsed.run == run_key(cfg.storage.uri, "exp-1") and parsed.of_run("exp-1")
    assert parsed.suffix.endswith(config_digest(cfg))
    assert RunActor.parse("someone-elses-actor") is None


def test_runs_of_one_name_under_different_roots_are_different_runs(tmp_path, monkeypatch):
    """Two checkouts both training `arithmetic-grpo` took each other's actors for stale ones
    of their own, and killed them."""
    monkeypatch.chdir(tmp_path)
    here = run_key("./runs", "exp-1")
    assert here == run_key(str(tmp_path / "runs") + "/", "exp-1")  # the same directory
    assert here != run_key("./other/runs", "exp-1") != run_key("s3://b/runs", "exp-1")
    # `runs stop` found nothing when the config wrote the root one way and --root another
    (tmp_path / "runs").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    assert here == run_key(f"file://{tmp_path}/runs", "exp-1") == run_key("link", "exp-1")
    assert run_key("s3://b/runs/", "exp-1") == run_key("s3://b/runs", "exp-1")
    actor = RunActor.parse(f"{here}:trainer@abc.def")
    assert actor is not None and actor.of_run(here) and actor.of_run("exp-1")
    assert not actor.of_run(run_key("./other/runs", "exp-1")) and not actor.of_run("exp-2")


def test_actors_import_from_the_drivers_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/opt/mine")
    cfg = _cfg(("cluster", "runtime_env", {"env_vars": {"A": "1"}, "py_modules": ["/x"]}))
    env = actor_runtime_env(cfg)
    paths = env["env_vars"]["PYTHONPATH"].split(":")
    assert paths[:2] == [str(tmp_path), "/opt/mine"]
    assert env["env_vars"]["A"] == "1" and env["py_modules"] == ["/x"]
    cfg = _cfg(("cluster", "runtime_env", {"env_vars": {"PYTHONPATH": "/envs:/more"}}))
    paths = actor_runtime_env(cfg)["env_vars"]["PYTHONPATH"].split(":")
    assert paths[:4] == ["/envs", "/more", str(tmp_path), "/opt/mine"]  # the user's first


def test_actors_get_a_short_openmp_spin_unless_told_otherwise(monkeypatch):
    for key in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(key, raising=False)
    assert actor_runtime_env(_cfg())["env_vars"]["GOMP_SPINCOUNT"] == OPENMP_WAIT["GOMP_SPINCOUNT"]
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the driver's own setting goes on
    env = actor_runtime_env(_cfg())["env_vars"]
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in env
    cfg = _cfg(("cluster", "runtime_env", {"env_vars": {"GOMP_SPINCOUNT": "5"}}))
    assert actor_runtime_env(cfg)["env_vars"]["GOMP_SPINCOUNT"] == "5"  # the config's wins


def test_a_head_of_another_environment_is_named_not_joined():
    state = {"address": "127.0.0.1:1", **environment()}
    check_environment(state)  # ours: fine
    with pytest.raises(ClusterMismatch, match="python: head '/other/bin/python', here"):
        check_environment({**state, "python": "/other/bin/python"})
    check_environment({"address": "127.0.0.1:1"})  # recorded by an older rollflow: no facts
    assert environment()["python"] == sys.executable


def test_every_section_but_the_drivers_shapes_the_actors():
    """The digests cover each section of the run config except the driver-only ones."""
    from engines.cluster.registry import DRIVER_ONLY
    from engines.config.run import ACTOR_SECTIONS
    from flows.config.run import RollflowConfig

    driver_only = {name for name, fields in DRIVER_ONLY.items() if fields is None}
    assert set(ACTOR_SECTIONS) == set(RollflowConfig.model_fields) - driver_only
    assert set(section_digests(_cfg())) == {*ACTOR_SECTIONS, "runtime_env"}


def test_a_worker_has_all_of_an_env_only_with_every_value_and_path_entry(tmp_path):
    from engines.cluster.registry import has_all

    worker = {"env": {"GOMP_SPINCOUNT": "1000"}, "pythonpath": [str(tmp_path), "/opt/x"]}
    assert has_all(worker, {"GOMP_SPINCOUNT": "1000", "PYTHONPATH": f"{tmp_path}:/opt/x"})
    assert has_all(worker, {"PYTHONPATH": str(tmp_path)})  # a subset of its path
    assert has_all(worker, {"PYTHONPATH": f"{tmp_path}/sub/.."})  # resolved as the worker does
    assert not has_all(worker, {"GOMP_SPINCOUNT": "5"})
    assert not has_all(worker, {"OMP_WAIT_POLICY": "PASSIVE"})  # a variable it lacks
    assert not has_all(worker, {"PYTHONPATH": f"{tmp_path}:/elsewhere"})


def test_a_head_gives_its_workers_rollflow_and_the_drivers_path_not_its_directory(
        tmp_path, monkeypatch):
    from engines.cluster.registry import ROOT, head_worker_env

    monkeypatch.chdir(tmp_path)
    env = head_worker_env({"PYTHONPATH": "/opt/mine"})
    assert env["PYTHONPATH"].split(":") == ["/opt/mine", str(ROOT)]
    assert env["GOMP_SPINCOUNT"] == OPENMP_WAIT["GOMP_SPINCOUNT"]
    assert head_worker_env({"OMP_WAIT_POLICY": "PASSIVE"})["OMP_WAIT_POLICY"] == "PASSIVE"
