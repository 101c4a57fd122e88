"""A user's own task, from their own directory, through the CLI (real Prefect, real Ray).

The Ray head of the test session was started in the repository root; every test here runs
the CLI from a temporary directory with relative paths, as a user would, so a path or hook
resolved against the wrong directory fails here.
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines.cluster.registry import run_actors
from flows.bookkeeping.driver_record import DriverRecord
from flows.bookkeeping.start_lines import FORCE_ENV, PREFIX
from flows.cli import main
from storage.run_layout import ACTORS_KEPT, RunLayout
from tests.support import REPO_ROOT

NAMESPACE = "rollflow-tests"
REWARD_FILE = '''
async def score(args, sample):
    return 0.25  # no built-in gives this: proof the user's function scored the sample


async def broken(args, sample):
    raise ValueError("this reward is broken")
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch, prefect_api, ray_address, tiny_model_dir):
    """A user's directory: a parquet of chat messages under its own keys, a reward file, a
    copy of the model; the shell is in it."""
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
            for a in range(10, 20) for b in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), work / "data" / "train.parquet")
    (work / "myreward.py").write_text(REWARD_FILE)
    shutil.copytree(tiny_model_dir, work / "model")
    monkeypatch.chdir(work)
    return work


def write_config(work: Path, run: str, ray_address: str, **extra: str) -> str:
    """run.yaml with relative paths only; `extra` replaces whole lines by key."""
    settings = {
        "reward": "custom_rm_path: myreward:score",
        "eval": "",
        "backend": "mock",
        "keep_actors": "false",
        "model": "model",
        **extra,
    }
    text = textwrap.dedent(f"""\
        cluster: {{address: "{ray_address}", namespace: {NAMESPACE}, actor_num_threads: 1,
                  keep_actors: {settings['keep_actors']}}}
        data: {{prompt_data: data/train.parquet, input_key: messages, label_key: answer,
               apply_chat_template: true}}
        rollout: {{num_rollout: 2, rollout_batch_size: 2, n_samples_per_prompt: 2,
                  max_response_len: 4, {settings['reward']}}}
        engine: {{backend: {settings['backend']}}}
        train: {{backend: {settings['backend'] if settings['backend'] == 'mock' else 'torch'},
                model_path: {settings['model']}, save_interval: 1}}
        storage: {{uri: ./runs, run_name: {run}}}
        logging: {{progress: false, plot: false}}
        {settings['eval']}
        """)
    (work / "run.yaml").write_text(text)
    return "run.yaml"


def run_name() -> str:
    return f"user-{uuid.uuid4().hex[:8]}"


def test_relative_paths_and_a_local_reward_make_one_whole_run_directory(
    workdir, ray_address, capsys, monkeypatch
):
    run = run_name()
    monkeypatch.setenv(FORCE_ENV, "1")  # the start's lines, as on a terminal
    capsys.readouterr()
    assert main(["train", "--config", write_config(workdir, run, ray_address)]) == 0
    told = [line.split("] ", 1)[1] for line in capsys.readouterr().err.splitlines()
            if line.startswith(PREFIX)]
    assert [line.split(":")[0] for line in told] == [
        "reading the config run.yaml", f"run {run}", "Prefect", "Ray", "actors", "step 0"], told
    layout = RunLayout.open(str(workdir / "runs"), run)
    assert layout.committed_steps() == [0, 1]
    names = set(layout.store.list())
    assert {"config.yaml", "steps", "datasource", "checkpoints"} <= names
    assert layout.store.list("checkpoints")  # written by the trainer actor, here too
    # the reward came from ./myreward.py, imported inside the rollout actor
    assert layout.step_metrics(0)["reward/mean"] == pytest.approx(0.25)
    assert not (REPO_ROOT / "runs" / run).exists()  # nothing where the Ray head started
    assert run_actors(NAMESPACE, run) == []  # a finished run releases its actors


def test_a_failed_run_rerun_with_a_fixed_config_uses_the_new_config(
    workdir, ray_address, capsys, fault_matrix
):
    run = run_name()
    bad = write_config(workdir, run, ray_address, reward="custom_rm_path: myreward:broken")
    assert main(["train", "--config", bad]) != 0
    left = run_actors(NAMESPACE, run)
    assert left  # a run that failed mid-step keeps its warm actors for a resume
    capsys.readouterr()

    fixed = write_config(workdir, run, ray_address)
    assert main(["train", "--config", fixed]) == 0
    layout = RunLayout.open(str(workdir / "runs"), run)
    assert layout.committed_steps() == [0, 1]
    assert layout.step_metrics(0)["reward/mean"] == pytest.approx(0.25)
    assert "myreward:score" in layout.store.read_text("config.yaml")
    assert "myreward:broken" in layout.store.read_text("configs", "000.yaml")
    assert run_actors(NAMESPACE, run) == []
    fault_matrix.add("reward hook raising; rerun with a fixed config", "step 0 generate",
                     "rerun replaces the old actors and uses the new config", None)


def test_an_eval_set_mistake_fails_before_step_0_naming_its_key(workdir, ray_address, capsys):
    (workdir / "data" / "test.jsonl").write_text(
        json.dumps({"q": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n")
    run = run_name()
    eval_line = ("eval: {datasets: [{name: test, path: data/test.jsonl, input_key: q, "
                 "apply_chat_template: false}]}")
    config = write_config(workdir, run, ray_address, eval=eval_line)
    capsys.readouterr()
    assert main(["train", "--config", config]) == 2
    first_line = capsys.readouterr().err.strip().splitlines()[0]
    assert "eval.datasets[0].apply_chat_template" in first_line
    assert "test.jsonl, line 1" in first_line
    assert run_actors(NAMESPACE, run) == []  # nothing was started
    assert not (workdir / "runs" / run / "steps").exists()


def test_actors_of_a_run_that_fails_at_start_up_are_torn_down(workdir, ray_address):
    weights = workdir / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # config and tokenizer still load
    run = run_name()
    config = write_config(workdir, run, ray_address, backend="embedded")
    assert main(["train", "--config", config]) != 0
    assert run_actors(NAMESPACE, run) == []


def test_runs_stop_frees_one_run_and_leaves_the_others(workdir, ray_address, capsys):
    mine, theirs = run_name(), run_name()
    for run in (mine, theirs):
        config = write_config(workdir, run, ray_address, keep_actors="true")
        assert main(["train", "--config", config]) == 0
    assert run_actors(NAMESPACE, mine) and run_actors(NAMESPACE, theirs)
    kept = {run: workdir / "runs" / run / ACTORS_KEPT for run in (mine, theirs)}
    assert kept[mine].exists() and kept[theirs].exists()
    capsys.readouterr()
    assert main(["runs", "stop", mine, "--address", ray_address, "--namespace", NAMESPACE]) == 0
    assert "stopped 3 actor(s)" in capsys.readouterr().out  # rollout, trainer, engine-0
    assert run_actors(NAMESPACE, mine) == []
    assert len(run_actors(NAMESPACE, theirs)) == 3
    # ./runs (the default --root, relative to the shell's directory) holds the markers
    assert not kept[mine].exists() and kept[theirs].exists()
    # the root spelled another way is the same root; a live driver is named, not left unsaid
    DriverRecord.of_this_process(None).write_to(RunLayout.open(str(workdir / "runs"), theirs))
    capsys.readouterr()
    root = f"file://{workdir / 'runs'}"
    assert main(["runs", "stop", theirs, "--root", root, "--address", ray_address,
                 "--namespace", NAMESPACE]) == 0
    out, err = capsys.readouterr()
    assert "stopped 3 actor(s)" in out and run_actors(NAMESPACE, theirs) == []
    assert f"its driver (pid {os.getpid()}) is still running" in err
    # an unknown run is an error, not "stopped 0"
    assert main(["runs", "stop", "no-such-run", "--address", ray_address,
                 "--namespace", NAMESPACE]) == 1
    assert "no run 'no-such-run' under ./runs" in capsys.readouterr().err
