"""The CLI's failure report: the root cause from inside Ray's wrappers, in one line first,
the right exit code, and the full traceback in a log file (or on screen with --verbose)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from ray.exceptions import ActorDiedError, RayTaskError, UnserializableException

from engines.data.prompt_dataset import DatasetError
from flows.bookkeeping.root_cause import exit_code, root_cause, summarize
from flows.cli import main
from flows.cli.errors import HeldBack, local_run_dir, report_failure
from flows.config.run import ConfigError

BAD_ROW = DatasetError("/data/train.jsonl", 3, "prompt", "empty prompt")


def task_error(cause: BaseException, where: str = "RolloutManager.__init__") -> RayTaskError:
    return RayTaskError(where.rsplit(".", 1)[-1], f"Traceback ...\n{cause!r}", cause,
                        proctitle=f"ray::{where}", pid=1, ip="127.0.0.1")


def test_actor_constructor_error_is_unwrapped_with_where():
    died = ActorDiedError(task_error(BAD_ROW))
    assert root_cause(died) is BAD_ROW
    assert summarize(died) == (
        "DatasetError: /data/train.jsonl, line 3, field 'prompt': empty prompt "
        "(in RolloutManager.__init__)"
    )
    assert exit_code(died) == 2


def test_a_named_actors_constructor_error_says_class_and_method_not_the_run():
    # The process title of a run's actor carries its name, `<run>:<role>@<digest>`, first.
    err = OSError("Error no file named model.safetensors, or pytorch_model.bin")
    where = "p-dot.v2:trainer@355c8acf.e37f5772:TrainActor.__init__"
    died = ActorDiedError(task_error(err, where))
    assert summarize(died).endswith("pytorch_model.bin (in TrainActor.__init__)")


def test_ray_dual_class_and_cause_chains_are_unwrapped():
    dual = task_error(BAD_ROW, "RolloutManager.generate").as_instanceof_cause()
    assert isinstance(dual, DatasetError) and root_cause(dual) is BAD_ROW
    try:
        raise RuntimeError("step 2 failed") from dual
    except RuntimeError as e:
        wrapped = e
    assert root_cause(wrapped) is BAD_ROW
    assert summarize(wrapped).endswith("empty prompt (in RolloutManager.generate)")


def test_an_input_errors_own_cause_is_a_detail():
    try:
        raise ConfigError("data.prompt_data: not valid YAML") from ValueError("col 3")
    except ConfigError as e:
        assert root_cause(e) is e
        assert summarize(e) == "ConfigError: data.prompt_data: not valid YAML"


def test_unknown_errors_summarize_as_type_and_message():
    err = ZeroDivisionError("division by zero")
    assert summarize(task_error(err, "TrainActor.train")) == (
        "ZeroDivisionError: division by zero (in TrainActor.train)"
    )
    assert exit_code(err) == 1
    assert summarize(AssertionError()) == "AssertionError"


def test_multiline_messages_become_one_line():
    err = ConfigError("invalid config:\n  rollout.top_k: bad\n  train.lr: must be > 0")
    assert summarize(err) == "ConfigError: invalid config: rollout.top_k: bad; train.lr: must be > 0"


def test_unserializable_exception_shows_the_remote_last_line():
    text = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n"
            "mypkg.errors.OddError: the real problem\n")
    assert summarize(UnserializableException(text)) == "OddError: the real problem"


# -- real Ray: what ray.get raises in the driver ----------------------------------------


# -- report, log file, CLI ------------------------------------------------------------------


def test_report_writes_the_log_in_the_run_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ROLLFLOW_HOME", str(tmp_path / "home"))
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    assert local_run_dir(str(tmp_path / "runs"), "r1") == run_dir
    assert local_run_dir(str(tmp_path / "runs"), "not-started") is None
    assert local_run_dir("s3://bucket/runs", "r1") is None

    try:
        raise ActorDiedError(task_error(BAD_ROW))
    except ActorDiedError as e:
        code = report_failure(e, run_dir=run_dir, command=["train"])
    first, second = capsys.readouterr().err.splitlines()[:2]
    assert code == 2 and first.startswith("DatasetError: /data/train.jsonl, line 3")
    log = Path(second.split("full traceback: ")[1].split(" ")[0])
    assert log.parent == run_dir / "logs" and log.name.startswith("error-")
    text = log.read_text()
    assert first in text and "Traceback" in text and "ActorDiedError" in text
    assert "\x1b[" not in text  # Ray's colours stay out of the file
    assert not (tmp_path / "home").exists()


def test_report_falls_back_to_rollflow_home(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ROLLFLOW_HOME", str(tmp_path / "home"))
    report_failure(ZeroDivisionError("division by zero"), run_dir=None)
    assert len(list((tmp_path / "home" / "logs").glob("error-*.log"))) == 1


@pytest.mark.parametrize("before", [True, False], ids=["verbose-first", "verbose-last"])
def test_cli_failure_output_and_verbose(tmp_path, monkeypatch, capsys, before):
    monkeypatch.setenv("ROLLFLOW_HOME", str(tmp_path))
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {prompt_data: x.jsonl}\nrollout: {num_rollout: 1, rollout_batch_size: 1, n_samples_per_prompt: 2}\n"
                   "engine: {backend: mock}\ntrain: {backend: mock}\n")
    args = ["train", "--config", str(cfg), "--set", "rollout.temprature=0.5"]
    assert main(args) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("ConfigError: invalid config: rollout.temprature")
    assert "full traceback:" in err[1] and "--verbose" in err[1] and len(err) == 2
    assert main(["--verbose", *args] if before else [*args, "--verbose"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0].startswith("ConfigError:") and "Traceback (most recent" in err


def test_held_back_keeps_failed_run_records_off_the_console():
    held = HeldBack()
    record = logging.LogRecord("prefect.task_runs", logging.ERROR, "x", 1, "failed", None, None)
    assert not held.filter(record) and held.records == [record]
    warning = logging.LogRecord("prefect.flow_runs", logging.WARNING, "x", 1, "slow", None, None)
    other = logging.LogRecord("rollflow", logging.ERROR, "x", 1, "mine", None, None)
    assert held.filter(warning) and held.filter(other) and held.records == [record]
    draining = logging.LogRecord("EventsWorker", logging.WARNING, "x", 1,
                                 "Still processing items: 1 items remaining...", None, None)
    assert not held.filter(draining) and held.records == [record, draining]


def test_a_note_on_the_cause_reaches_the_first_line():
    from flows.bookkeeping.root_cause import summarize

    err = AttributeError("'list' object has no attribute 'response'")
    err.add_note("rollout.group_rm=true calls rollout.custom_rm_path once per group")
    assert summarize(RuntimeError("wrapper")) == "RuntimeError: wrapper"
    assert summarize(err).endswith("(rollout.group_rm=true calls rollout.custom_rm_path once "
                                   "per group)")


def test_only_the_last_20_tracebacks_are_kept(tmp_path, monkeypatch, capsys):
    """Every config typo writes a log: a session of them must not pile up in ~/.rollflow."""
    from flows.cli.errors import KEPT_LOGS

    monkeypatch.setenv("ROLLFLOW_HOME", str(tmp_path / "home"))
    for i in range(KEPT_LOGS + 5):
        report_failure(ValueError(f"failure {i}"), run_dir=None)
    logs = sorted((tmp_path / "home" / "logs").glob("error-*.log"))
    assert KEPT_LOGS == 20 and len(logs) == KEPT_LOGS
    assert "failure 5" in logs[0].read_text() and "failure 24" in logs[-1].read_text()
