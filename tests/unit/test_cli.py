"""`rollflow runs list|show` over a run directory, and config errors at the CLI."""

from __future__ import annotations

import pytest

from flows.cli import main
from storage.run_layout import RunLayout


def make_run(root, name, steps, num_rollout=None, loss_type="policy_loss"):
    layout = RunLayout.open(str(root), name)
    layout.store.write_text(f"rollout: {{num_rollout: {num_rollout or steps}}}\n"
                            f"algorithm: {{loss_type: {loss_type}}}\n", "config.yaml")
    for k in range(steps):
        layout.store.write_json({"rollout_id": k, "reward/mean": 0.25 * k, "train/loss": 1.5},
                                f"steps/{k:06d}", "metrics.json")
        layout.mark_committed(k)
    layout.save_eval(steps, {"eval/test": 0.75})
    return layout


def test_runs_list_and_show(tmp_path, capsys):
    make_run(tmp_path, "alpha", 3)
    make_run(tmp_path, "beta", 1)
    (tmp_path / "not-a-run").mkdir()
    assert main(["runs", "list", "--root", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split("\t") for ln in lines] == [
        ["alpha", "complete", "steps=3/3", "eval/test=0.75"],
        ["beta", "complete", "steps=1/1", "eval/test=0.75"]]

    assert main(["runs", "show", "alpha", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == "run alpha: complete, 3/3 steps committed"
    assert out[1].split("\t")[:3] == ["rollout_id", "reward/mean", "train/loss"]
    assert [row.split("\t")[1] for row in out[2:5]] == ["0", "0.25", "0.5"]
    assert out[5].startswith("eval@v3") and "eval/test=0.75" in out[5]


def test_every_commands_stdout_holds_only_its_own_output(tmp_path, capsys, monkeypatch):
    """Ray's log thread prints its "(raylet)" warnings to whatever sys.stdout is at the time,
    here while the command reads the run: they go to stderr, so a script can parse stdout."""
    make_run(tmp_path, "alpha", 2)
    committed = RunLayout.committed_steps

    def noisy(self):
        print("(raylet) [2026-11-22 17:00:00] WARNING: a message from Ray's log monitor")
        return committed(self)

    monkeypatch.setattr(RunLayout, "committed_steps", noisy)
    assert main(["runs", "list", "--root", str(tmp_path)]) == 0
    assert main(["runs", "show", "alpha", "--root", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert [ln.split("\t")[0] for ln in lines] == [
        "alpha", "run alpha: complete, 2/2 steps committed", "rollout_id", "0", "1", "eval@v2"]
    assert captured.err.count("(raylet)") >= 2  # once or more per command


def test_runs_show_unknown_run(tmp_path, capsys):
    assert main(["runs", "show", "nope", "--root", str(tmp_path)]) == 1
    assert "no run 'nope'" in capsys.readouterr().err
    # options may come before the run's name too (it was taken for an unrecognized argument)
    assert main(["runs", "show", "--root", str(tmp_path), "nope"]) == 1
    assert "no run 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["runs", "stop"])  # a run to stop is required


def test_replay_of_a_missing_run_says_so_before_starting_a_prefect_server(
    tmp_path, capsys, monkeypatch
):
    def no_server():
        raise AssertionError("a Prefect server was started")

    monkeypatch.setattr("flows.servers.prefect_server.local_prefect_api", no_server)
    assert main(["replay", "nope", "--steps", "0:1", "--root", str(tmp_path)]) == 1
    assert "no run 'nope'" in capsys.readouterr().err


def test_train_with_bad_override_names_the_key(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {prompt_data: x.jsonl}\nrollout: {num_rollout: 1, rollout_batch_size: 1, n_samples_per_prompt: 2}\n"
                   "engine: {backend: mock}\ntrain: {backend: mock}\n")
    assert main(["train", "--config", str(cfg), "--set", "rollout.temprature=0.5"]) == 2
    assert "rollout.temprature" in capsys.readouterr().err


def test_the_prefect_server_gets_the_server_settings_under_the_users_own(monkeypatch, tmp_path):
    """`rollflow server`'s environment: the users' variables win, the server's settings fill
    the rest (from the same defaults the CLI puts in its own environment), the CLI's console
    logging levels are left out, and no PREFECT_API_URL points it at another server."""
    import os

    from flows.servers.prefect_env import PREFECT_ENV_DEFAULTS, SERVER_SETTINGS
    from flows.servers.prefect_server import server_env

    batch = "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"
    for key in PREFECT_ENV_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(batch, "7")
    monkeypatch.setenv("PREFECT_API_URL", "http://elsewhere:4200/api")
    env = server_env(str(tmp_path))
    assert env[batch] == "7"
    assert {k: env[k] for k in SERVER_SETTINGS if k != batch} == {
        k: v for k, v in SERVER_SETTINGS.items() if k != batch}
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL" not in env
    assert "PREFECT_API_URL" not in env and env["PREFECT_HOME"] == str(tmp_path)
    assert os.environ[batch] == "7" and "PREFECT_SERVER_ANALYTICS_ENABLED" not in os.environ


def test_ctrl_c_prints_one_line_and_exits_130(monkeypatch, capsys, tmp_path):
    """Ctrl-C ends the command in one line, not in an 85-line KeyboardInterrupt traceback."""
    import flows.cli.commands as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_runs", interrupted)
    assert cli.main(["runs", "list", "--root", str(tmp_path)]) == 130
    err = capsys.readouterr().err
    assert err.strip() == ("interrupted: committed steps are kept; run the same command again "
                           "to resume")


def test_a_server_on_a_port_in_use_is_refused_naming_the_port(capsys):
    """Not: print the address of the server already there as its own, then exit."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["server", "--port", str(port)]) == 2
    assert f"127.0.0.1:{port} is in use" in capsys.readouterr().err


def test_runs_list_and_show_tell_failed_and_stopped_runs_apart(tmp_path, capsys):
    """A step that raised, a run whose preflight failed (a log, no config.yaml), a Ctrl-C: each
    listed with its status and cause, and `runs show` names the command that resumes it."""
    make_run(tmp_path, "broken", 1, num_rollout=3).mark_failed(
        1, "RayTaskError(...)\nlong", "HookError: rollout.custom_rm_path: it broke")
    make_run(tmp_path, "halted", 1, num_rollout=3).mark_failed(
        1, "KeyboardInterrupt()", "KeyboardInterrupt", interrupted=True)
    logs = tmp_path / "early" / "logs"
    logs.mkdir(parents=True)
    (logs / "error-20261128-020000-000001.log").write_text(
        "rollflow train --config bad.yaml\nConfigError: data.prompt_data: no such file\n\nTb")
    assert main(["runs", "list", "--root", str(tmp_path)]) == 0
    assert [ln.split("\t") for ln in capsys.readouterr().out.splitlines()] == [
        ["broken", "failed", "steps=1/3", "step 1: HookError: rollout.custom_rm_path: it broke"],
        ["early", "failed", "steps=0", "ConfigError: data.prompt_data: no such file"],
        ["halted", "stopped", "steps=1/3", "step 1: KeyboardInterrupt"]]

    assert main(["runs", "show", "broken", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:3] == [
        "run broken: failed, 1/3 steps committed",
        "cause: step 1: HookError: rollout.custom_rm_path: it broke",
        f"to resume: rollflow train --config {tmp_path / 'broken' / 'config.yaml'}"]
    assert main(["runs", "show", "early", "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "run early: failed, 0 steps committed",
        "cause: ConfigError: data.prompt_data: no such file",
        "to resume: rollflow train --config bad.yaml"]  # no empty table header


def test_an_sft_run_shows_its_loss_not_a_reward(tmp_path, capsys):
    from flows.bookkeeping.run_status import headline_metric

    make_run(tmp_path, "sft", 2, loss_type="sft_loss")
    assert main(["runs", "show", "sft", "--root", str(tmp_path)]) == 0
    header = capsys.readouterr().out.splitlines()[1].split("\t")
    assert "reward/mean" not in header and "train/loss" in header
    # the progress bar's figure (flows/train.py StepReporter)
    assert headline_metric("sft_loss") == "train/loss"
    assert headline_metric("policy_loss") == "reward/mean"


def _undocumented(parser, path="rollflow"):
    """Each (sub)command without a description, each action without help, under `parser`."""
    import argparse

    missing = [] if parser.description else [f"{path}: no description"]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {c.dest: c.help for c in action._choices_actions}
            for name, sub in action.choices.items():
                missing += [] if listed.get(name) else [f"{path} {name}: no help"]
                missing += _undocumented(sub, f"{path} {name}")
        elif not (action.help or "").strip():
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_command_and_option_has_help():
    from flows.cli.commands import build_parser

    parser = build_parser()
    assert _undocumented(parser) == []
    assert "runs list|show|stop" in parser.description and "`engine`" in parser.description
    train = build_parser()._subparsers._group_actions[0].choices["train"]
    assert "resume" in train.description and "--fresh" in train.description


def test_an_unknown_option_shows_its_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as refused:
        main(["train", "--config", "x.yaml", "--nope"])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: rollflow train ") and "unrecognized arguments: --nope" in err
    with pytest.raises(SystemExit):
        main(["runs", "list", "--nope"])
    assert capsys.readouterr().err.startswith("usage: rollflow runs list ")


def test_runs_stop_of_an_unknown_run_says_only_that(tmp_path, capsys, monkeypatch):
    from engines.cluster import head

    monkeypatch.setattr(head, "cluster_address", lambda cfg, start=True: None)
    assert main(["runs", "stop", "nosuchrun", "--root", str(tmp_path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == f"no run 'nosuchrun' under {tmp_path}"


def test_cluster_status_without_a_head_says_so():
    from flows.cli.commands import format_status

    status = {"address": None, "alive": False, "actors": [], "placement_groups": []}
    assert format_status(status) == "no local Ray head running (`rollflow cluster up` starts one)"


def test_train_fresh_deletes_the_run_and_its_actors(tmp_path, monkeypatch):
    """Not on a terminal, so no question; the run's actors go with its directory."""
    from types import SimpleNamespace

    from engines.cluster import actors, head
    from flows.cli.commands import start_over
    from storage.config import StorageConfig

    make_run(tmp_path, "alpha", 2)
    killed = []
    monkeypatch.setattr(head, "cluster_address", lambda cfg, start=True: "127.0.0.1:6379")
    monkeypatch.setattr(head, "connect", lambda cfg: "127.0.0.1:6379")
    monkeypatch.setattr(actors, "kill_run_actors", killed.append)
    monkeypatch.setattr("sys.stdin", SimpleNamespace(isatty=lambda: False))
    cfg = SimpleNamespace(storage=StorageConfig(uri=str(tmp_path), run_name="alpha"),
                          cluster=None)
    assert start_over(cfg) and killed == [cfg]
    assert not (tmp_path / "alpha").exists()
    assert start_over(cfg)  # nothing to delete


def test_commands_on_existing_runs_open_s3_with_the_storage_retries() -> None:
    """`runs`, `replay` and friends read the store as a training does: through botocore's
    retries (`storage.retries`), with credentials from `--set storage.*`."""
    import argparse

    from flows.cli.commands import _runs_root

    args = argparse.Namespace(root="s3://bucket/runs", endpoint_url="http://127.0.0.1:9",
                              set=["storage.retries.max_attempts=3",
                                   "storage.storage_options={key: k, secret: s}"])
    store = _runs_root(args)
    assert store.storage_options["config_kwargs"]["retries"]["max_attempts"] == 3
    assert store.storage_options["key"] == "k"
