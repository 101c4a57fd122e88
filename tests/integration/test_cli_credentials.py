"""`rollflow train` with s3:// storage or prompt data and no S3 credentials anywhere (no
`AWS_*`, no credentials files, no instance metadata): it exits 2, the code for config and
data errors, and its first line names the URI, the config key and what to set. No S3 server
is needed: botocore fails before sending a request."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flows.config.loader import dump_config
from tests.support import REPO_ROOT
from tests.support.configs import arithmetic_config


@pytest.mark.parametrize("key, uri", [
    ("storage.uri", "s3://bucket/x"),
    ("data.prompt_data", "s3://bucket/x/train.jsonl"),
])
def test_missing_s3_credentials_exit_2_naming_uri_key_and_fix(
    key, uri, arithmetic_data, tiny_model_dir, tmp_path
):
    cfg = arithmetic_config(run_name="nocreds", runs_root=str(tmp_path / "runs"),
                            data=arithmetic_data, model_dir=tiny_model_dir,
                            ray_address="127.0.0.1:1", overrides=[f"{key}={uri}"])
    config = tmp_path / "nocreds.yaml"
    config.write_text(dump_config(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent",
               AWS_EC2_METADATA_DISABLED="true", PYTHONPATH=str(REPO_ROOT),
               ROLLFLOW_HOME=str(tmp_path / "home"))
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "train", "--config", str(config)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2, done.stderr
    first = done.stderr.splitlines()[0]
    assert first.startswith(f"ConfigError: {key}: no S3 credentials"), done.stderr
    assert uri in first and "AWS_ACCESS_KEY_ID" in first and "AWS_SECRET_ACCESS_KEY" in first
    assert "storage.storage_options" in first and "storage.credentials_block" in first
