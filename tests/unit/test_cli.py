"""`rollflow runs list|show` over a run directory, and config errors at the CLI."""

from __future__ import annotations

import pytest

from flows.cli import main
from storage.run_layout import RunLayout


def make_run(root, name, steps):
    layout = RunLayout.open(str(root), name)
    layout.store.write_text("data: {}\n", "config.yaml")
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
    assert [ln.split("\t")[0] for ln in lines] == ["alpha", "beta"]
    assert "steps=3" in lines[0] and "eval/test=0.75" in lines[0]

    assert main(["runs", "show", "alpha", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].split("\t")[:3] == ["rollout_id", "reward/mean", "train/loss"]
    assert [row.split("\t")[1] for row in out[1:4]] == ["0", "0.25", "0.5"]
    assert out[4].startswith("eval@v3") and "eval/test=0.75" in out[4]


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
    assert [ln.split("\t")[0] for ln in lines] == ["alpha", "rollout_id", "0", "1", "eval@v2"]
    assert captured.err.count("(raylet)") == 2


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
