"""`rollflow train` on a dataset with an empty prompt, as a user runs it: the cause (file, line,
field) is the first line on stderr, not Ray's or Prefect's tracebacks; the exit code is 2;
the traceback is in the run directory's log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from flows.config_loader import dump_config
from tests.conftest import REPO_ROOT
from tests.flow.configs import arithmetic_config


def test_bad_row_fails_with_the_cause_first(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    rows = Path(arithmetic_data["train"]).read_text().splitlines()[:8]
    bad_row = json.loads(rows[1])
    bad_row["prompt"] = "  "
    rows[1] = json.dumps(bad_row)
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows) + "\n")
    cfg = arithmetic_config(
        run_name=f"bad-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
        data={**arithmetic_data, "train": str(data)}, model_dir=tiny_model_dir,
        ray_address=ray_address,
    )
    config = tmp_path / "bad.yaml"
    config.write_text(dump_config(cfg))
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(REPO_ROOT),
           "ROLLFLOW_HOME": str(tmp_path / "home")}

    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--config", str(config)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )

    lines = done.stderr.splitlines()
    assert done.returncode == 2, done.stderr
    assert lines[0].startswith(f"DatasetError: {data}, line 2, field 'prompt': empty prompt"), (
        done.stderr)
    log = Path(lines[1].split("full traceback: ")[1].split(" ")[0])
    assert log.is_file() and "Traceback" in log.read_text()
    run_dir = Path(cfg.storage.uri) / cfg.storage.run_name
    if run_dir.is_dir():  # the run got as far as creating its directory
        assert log.parent == run_dir / "logs"
    assert len(lines) == 2, done.stderr
