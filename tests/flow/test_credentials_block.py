"""Storage credentials from a Prefect Secret block (`storage.credentials_block`): a run on S3
whose config names only the block (its S3 endpoint and keys are in the block, so no part of
the run reaches the bucket without it), config.yaml without the keys, and a replay that
finds them again from the block; a missing or malformed block is a config error."""

from __future__ import annotations

import uuid

import pytest

from flows.cli import main
from flows.config.loader import dump_config
from flows.config.run import ConfigError
from flows.config.storage_credentials import with_storage_credentials
from storage.object_store import open_store
from storage.run_layout import RunLayout
from tests.support.configs import arithmetic_config


def _save_secret(value: object) -> str:
    from prefect.blocks.system import Secret

    name = f"creds-{uuid.uuid4().hex[:8]}"
    Secret(value=value).save(name)
    return name


def test_a_run_on_s3_finds_its_credentials_in_a_secret_block(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, s3_server
):
    from flows.train import train

    block = _save_secret({"key": "testing", "secret": "testing",
                          "endpoint_url": s3_server.endpoint_url})
    root = s3_server.bucket(f"creds-{uuid.uuid4().hex[:8]}") + "/runs"
    run = f"block-{uuid.uuid4().hex[:6]}"
    cfg = arithmetic_config(
        run_name=run, runs_root=root, data=arithmetic_data, model_dir=tiny_model_dir,
        ray_address=ray_address, overrides=[f"storage.credentials_block={block}"],
    )
    assert cfg.storage.endpoint_url is None and cfg.storage.storage_options == {}
    result = train(cfg)
    assert result["run_dir"] == f"{root}/{run}"

    store = open_store(root, s3_server.endpoint_url, **s3_server.storage_options)
    layout = RunLayout(store.child(run))
    assert layout.committed_steps() == [0, 1]
    text = layout.store.read_text("config.yaml")
    assert f"credentials_block: {block}" in text
    assert "testing" not in text  # the keys stay in the block

    # The replay's config comes from config.yaml: the keys come back from the block.
    assert main(["replay", run, "--steps", "1:2", "--root", root,
                 "--endpoint-url", s3_server.endpoint_url]) == 0
    replayed = RunLayout(store.child(f"{run}-replay-1-2"))
    assert replayed.committed_steps() == [1]
    assert replayed.step_metrics(1)["train/loss"] == layout.step_metrics(1)["train/loss"]


def test_options_in_the_config_win_over_the_block(prefect_api, arithmetic_data, tmp_path):
    block = _save_secret({"key": "from-block", "secret": "s3cr3t-from-block"})
    cfg = arithmetic_config(
        run_name="r", runs_root=str(tmp_path), data=arithmetic_data, model_dir=str(tmp_path),
        ray_address="", overrides=[f"storage.credentials_block={block}",
                                   "storage.storage_options={key: from-config}"],
    )
    merged = with_storage_credentials(cfg)
    assert merged.storage.storage_options == {"key": "from-config", "secret": "s3cr3t-from-block"}
    assert "s3cr3t-from-block" in merged.secret_values()
    assert cfg.storage.storage_options == {"key": "from-config"}  # the input is unchanged


@pytest.mark.parametrize("value, expected", [
    (None, "no Secret block of that name"),
    ("just-a-string", "the Secret holds a str; expected a JSON object of storage options"),
])
def test_a_missing_or_malformed_block_is_a_config_error(
    prefect_api, arithmetic_data, tmp_path, value, expected
):
    block = f"absent-{uuid.uuid4().hex[:8]}" if value is None else _save_secret(value)
    cfg = arithmetic_config(
        run_name="r", runs_root=str(tmp_path), data=arithmetic_data, model_dir=str(tmp_path),
        ray_address="", overrides=[f"storage.credentials_block={block}"],
    )
    with pytest.raises(ConfigError, match=f"storage.credentials_block={block!r}: {expected}"):
        with_storage_credentials(cfg)


def test_the_drivers_aws_keys_travel_with_the_config_to_the_actors(
    arithmetic_data, tmp_path, monkeypatch
):
    """Exported after the Ray head started, AWS_* never reached the actors: the run failed in
    the first actor to read the bucket. They now ride in storage_options (redacted in every
    dump), unless the config or a block names credentials itself."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFROMENV")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-from-env")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)

    def config(root: str, *overrides: str):
        return arithmetic_config(run_name="r", runs_root=root, data=arithmetic_data,
                                 model_dir=str(tmp_path), ray_address="", overrides=list(overrides))

    on_s3 = with_storage_credentials(config("s3://bucket/runs"))
    assert on_s3.storage.storage_options == {"key": "AKIAFROMENV", "secret": "s3cr3t-from-env"}
    assert "s3cr3t-from-env" not in dump_config(on_s3)
    assert with_storage_credentials(config(str(tmp_path))).storage.storage_options == {}
    own = config("s3://bucket/runs", "storage.storage_options={profile: research}")
    assert with_storage_credentials(own).storage.storage_options == {"profile": "research"}
