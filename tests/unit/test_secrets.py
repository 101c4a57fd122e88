"""Secrets are hidden by value: under any option name, in URLs, in logs and error logs."""

from __future__ import annotations

import logging

import yaml

from flows.cli.errors import report_failure
from flows.config.loader import config_from_dict, dump_config
from storage.secrets import REDACTED, redact_options, redact_url, scrub


def _cfg(**sections):
    raw = {
        "data": {"prompt_data": "/d/train.jsonl"},
        "rollout": {"num_rollout": 1, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
        "train": {"model_path": "/m"},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def test_every_string_option_is_hidden_except_known_settings():
    options = {"key": "AKIA1234", "my_bearer": "tok-9876", "anon": False, "profile": "dev",
               "client_kwargs": {"region_name": "eu-west-1", "headers": ["x-auth-4321"]}}
    assert redact_options(options) == {
        "key": REDACTED, "my_bearer": REDACTED, "anon": False, "profile": "dev",
        "client_kwargs": {"region_name": "eu-west-1", "headers": [REDACTED]},
    }


def test_url_credentials_are_hidden_and_the_rest_kept():
    assert redact_url("http://bob:hunter22@rm.local:8000/score?api_key=abcd&x=1") == (
        f"http://bob:{REDACTED}@rm.local:8000/score?api_key={REDACTED}&x=1")
    assert redact_url("http://rm.local:8000/score") == "http://rm.local:8000/score"


def test_config_yaml_and_repr_show_no_secret_values():
    cfg = _cfg(storage={"storage_options": {"bearer": "tok-secret-1"},
                        "endpoint_url": "http://u:pw-secret-2@minio:9000"},
               rollout={"rm_url": "http://u:pw-secret-3@rm:1/x"},
               engine={"backend": "sglang", "urls": ["http://u:pw-secret-4@gpu0:30000"]},
               train={"weight_sync": "distributed"})
    text = dump_config(cfg) + repr(cfg)
    for secret in ("tok-secret-1", "pw-secret-2", "pw-secret-3", "pw-secret-4"):
        assert secret not in text
    assert yaml.safe_load(dump_config(cfg))["rollout"]["rm_url"] == f"http://u:{REDACTED}@rm:1/x"
    assert cfg.storage.storage_options == {"bearer": "tok-secret-1"}  # actors get the value


def test_logs_and_error_logs_are_scrubbed(tmp_path, caplog):
    _cfg(storage={"storage_options": {"bearer": "tok-secret-5"}})  # loading registers it
    assert scrub("auth failed for tok-secret-5") == f"auth failed for {REDACTED}"
    handler = logging.StreamHandler()
    logging.getLogger().addHandler(handler)
    try:
        from storage.secrets import install_scrubbing

        install_scrubbing()
        record = logging.LogRecord("x", logging.WARNING, __file__, 1, "token %s", ("tok-secret-5",),
                                   None)
        for f in handler.filters:
            f.filter(record)
        assert record.getMessage() == f"token {REDACTED}"
    finally:
        logging.getLogger().removeHandler(handler)
    import io

    out = io.StringIO()
    report_failure(RuntimeError("cannot reach s3 with tok-secret-5"), run_dir=tmp_path,
                   stream=out, command=["train"])
    assert "tok-secret-5" not in out.getvalue()
    log = next((tmp_path / "logs").iterdir()).read_text()
    assert "tok-secret-5" not in log and REDACTED in log
