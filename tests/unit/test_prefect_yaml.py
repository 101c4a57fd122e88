"""prefect.yaml: every deployment points at a flow of this repo whose parameters validate,
and every path in its config exists in the repo."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from tests.support import REPO_ROOT

DEPLOYMENTS = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())["deployments"]


def load_flow(entrypoint: str):
    path, name = entrypoint.split(":")
    return getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)


def test_one_deployment_per_flow():
    flows = sorted(load_flow(d["entrypoint"]).name for d in DEPLOYMENTS)
    assert flows == ["evaluate", "replay", "train"]
    assert {d["work_pool"]["name"] for d in DEPLOYMENTS} == {"rollflow-process"}
    assert all({"rollflow", load_flow(d["entrypoint"]).name} <= set(d["tags"]) for d in DEPLOYMENTS)


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_parameters_validate_and_paths_exist(deployment, tmp_path):
    """Paths point at what the main job (examples/arithmetic/run.py) writes; build those
    files the same way under a temporary root and check every path resolves there."""
    from examples.arithmetic.build_model import save_tiny_model
    from examples.arithmetic.make_data import write_datasets

    artifacts = tmp_path / "examples" / "arithmetic" / "artifacts"
    write_datasets(str(artifacts / "data"), n_train=40, n_test=10, n_sft=10)
    save_tiny_model(str(artifacts / "tiny-llama"), num_layers=1, hidden_size=32)
    flow = load_flow(deployment["entrypoint"])
    params = flow.validate_parameters(deployment["parameters"])
    cfg = params["config"]
    for path in (cfg.data.prompt_data, cfg.train.model_path,
                 *(d.path for d in cfg.eval.datasets)):
        assert path is not None and Path(tmp_path, path).exists(), path
