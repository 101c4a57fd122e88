"""`rollout.environment`: the config, an environment's tasks as prompt rows, and its
episodes as the gateway's agent (engines/environments/), with a user-written environment."""

from __future__ import annotations

import asyncio
import json
import pickle
from typing import Any

import numpy as np
import pytest

from engines.data.prompt_files import DatasetError, DatasetSpec, open_rows
from engines.environments.base import EnvironmentError, EnvironmentTask, EpisodeResult
from engines.environments.registry import close_environments, open_environment
from engines.environments.rows import environment_agent
from engines.rollout.restore import Outcome
from engines.rollout.rollout_manager import EveryGroupFailed
from engines.rollout.step_groups import StepGroups
from flows.config.loader import config_from_dict
from flows.config.run import ConfigError
from storage.sample import Sample, Status

USER_ENV = "tests.support.user_environment:make?size=3"


@pytest.fixture(autouse=True)
def fresh_environments():
    yield
    close_environments()


def config(data: dict[str, Any] | None = None, **rollout: Any) -> Any:
    return config_from_dict({
        **({"data": data} if data else {}),
        "rollout": {"num_rollout": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
                    **rollout},
        "engine": {"backend": "mock"}, "train": {"backend": "mock"}})


def test_the_environment_names_the_prompts_unless_data_does():
    cfg = config(environment=USER_ENV)
    assert cfg.data.prompt_data == USER_ENV
    other = "tests.support.user_environment:make?size=9"
    assert config({"prompt_data": other}, environment=USER_ENV).data.prompt_data == other
    with pytest.raises(ConfigError, match=r"data.prompt_data names 'mine.jsonl', whose "
                       r"rows carry no task of it; leave data.prompt_data unset"):
        config({"prompt_data": "mine.jsonl"}, environment=USER_ENV)


@pytest.mark.parametrize("key, value", [("rm_type", "math"), ("agent_path", "a.b:c"),
                                        ("custom_generate_function_path", "a.b:c"),
                                        ("custom_rm_path", "a.b:c")])
def test_the_environment_excludes_other_rewards_and_generators(key, value):
    with pytest.raises(ConfigError, match=rf"rollout.environment excludes rollout.{key}"):
        config(environment=USER_ENV, **{key: value})


@pytest.mark.parametrize("uri", ["data/train.jsonl", "s3://bucket/x", "gym://cartpole"])
def test_a_value_that_is_no_environment_is_refused_by_name(uri):
    with pytest.raises(ConfigError, match=r"rollout.environment"):
        config(environment=uri)


def test_rows_carry_the_whole_task_in_their_metadata():
    rows = open_rows(DatasetSpec(USER_ENV))
    assert len(rows) == 3
    (_, line, row), = rows.rows(np.array([1]))
    assert line == 2 and row["prompt"] == "11+4=" and row["label"] == "15"
    assert row["metadata"]["environment"] == {
        "uri": USER_ENV, "split": "train", "index": 1,
        "task": {"prompt": "11+4=", "answer": "15", "data": {"a": 11, "b": 4}}}
    (_, _, held_out), = open_rows(DatasetSpec(USER_ENV, config_key="eval.datasets[0]")).rows(
        np.array([0]))
    assert held_out["prompt"] == "1010+2=" and held_out["metadata"]["environment"]["split"] == "eval"


def test_an_environment_opens_once_per_process():
    assert open_environment(USER_ENV) is open_environment(USER_ENV)
    env = open_environment(USER_ENV)
    close_environments()
    assert env.closed and open_environment(USER_ENV) is not env


def test_a_task_json_cannot_keep_is_refused_naming_it(monkeypatch):
    env = open_environment(USER_ENV)
    tasks = env.tasks("train")
    monkeypatch.setattr(env, "tasks", lambda split: [*tasks[:2], EnvironmentTask(
        "x", None, {"when": object()})])
    with pytest.raises(DatasetError, match=r"task 2 cannot be stored as JSON.*prompt_data"):
        open_rows(DatasetSpec(USER_ENV))


@pytest.mark.parametrize("uri, problem", [
    ("tests.support.user_environment:nothing", "cannot import"),
    ("tests.support.user_environment:make?size=0", "no train tasks"),
])
def test_an_environment_that_cannot_open_names_the_key(uri, problem):
    with pytest.raises(DatasetError, match=rf"{problem}.*\(data.prompt_data\)"):
        open_rows(DatasetSpec(uri))


def test_a_split_an_environment_lacks_is_refused():
    with pytest.raises(DatasetError, match=r"split 'test'.*set eval.datasets\[0\].split"):
        open_rows(DatasetSpec(USER_ENV, split="test", config_key="eval.datasets[0]"))


class Scripted:
    """An environment whose episode reward is the task's `a`, recording what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, EnvironmentTask, int]] = []

    async def run_episode(self, base_url: str, task: EnvironmentTask, seed: int) -> EpisodeResult:
        self.calls.append((base_url, task, seed))
        return EpisodeResult(float(task.data["a"]), {"turns": 2.0})


def test_a_sample_plays_its_own_task_with_its_seed(monkeypatch):
    (_, _, row), = open_rows(DatasetSpec(USER_ENV)).rows(np.array([2]))
    env = Scripted()
    monkeypatch.setattr("engines.environments.rows.open_environment", lambda uri: env)
    sample = Sample(index=5, group_index=2, prompt=row["prompt"],
                    metadata=json.loads(json.dumps(row["metadata"])))
    reward = asyncio.run(environment_agent(USER_ENV)(
        "http://gw/s/k/v1", sample, sampling_params={"sampling_seed": 1239}))
    assert reward == 12.0
    assert env.calls == [("http://gw/s/k/v1", EnvironmentTask("12+5=", "17", {"a": 12, "b": 5}),
                          1239)]
    assert sample.metadata["environment"]["metrics"] == {"turns": 2.0}


def test_a_sample_from_elsewhere_fails_naming_it():
    sample = Sample(index=7, group_index=0, prompt="1+1=", metadata={"source_line": 3})
    with pytest.raises(EnvironmentError, match=r"sample 7 \(prompt line 3\) has no metadata"):
        asyncio.run(environment_agent(USER_ENV)("http://gw", sample))


def test_a_step_remembers_why_its_first_failed_group_failed():
    """What `EveryGroupFailed` reports when a step keeps nothing: the first failed sample and
    its agent's error, not "train() got no samples" three task attempts later."""
    ok = Sample(index=0, group_index=0, prompt="p", status=Status.COMPLETED)
    bad = [Sample(index=i, group_index=1, prompt="p", status=Status.FAILED,
                  metadata={"source_line": 4, "agent_error": f"ConnectionError('down {i}')"})
           for i in (2, 3)]
    groups = StepGroups()
    groups.add([ok], Outcome.KEPT)
    groups.add([ok, bad[0]], Outcome.FAILED)
    groups.add([bad[1]], Outcome.FAILED)
    assert groups.counts["failed"] == 2
    assert groups.first_failure == "sample 2 (prompt line 4): ConnectionError('down 2')"
    error = EveryGroupFailed(3, groups.counts["failed"], 2, groups.first_failure)
    assert str(pickle.loads(pickle.dumps(error))) == (
        "rollout 3: every group failed (2 of 2 drawn), so there is nothing to train; the "
        "first: sample 2 (prompt line 4): ConnectionError('down 2')")
