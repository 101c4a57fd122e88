"""Errors raised inside real Ray actors and tasks summarise as they do from the fakes."""

from __future__ import annotations

import pytest
import ray
from ray.exceptions import ActorDiedError, RayTaskError

from engines.data.prompt_dataset import DatasetError
from engines.hooks.loader import HookError
from flows.bookkeeping.root_cause import exit_code, root_cause, summarize

BAD_ROW = DatasetError("/data/train.jsonl", 3, "prompt", "empty prompt")


@ray.remote
def raise_in_task() -> None:
    raise BAD_ROW


@ray.remote
class FailingActor:
    def __init__(self) -> None:
        raise HookError("rollout.custom_rm_path: cannot import 'myreward'")

    def ping(self) -> int:
        return 1


@ray.remote
def call_failing_actor() -> int:
    return ray.get(FailingActor.remote().ping.remote())


def raised_by(ref: ray.ObjectRef) -> BaseException:
    with pytest.raises(Exception) as err:
        ray.get(ref)
    return err.value


def test_real_ray_errors(ray_address):
    from_task = raised_by(raise_in_task.remote())
    assert isinstance(from_task, RayTaskError)
    root = root_cause(from_task)
    assert type(root) is DatasetError and (root.path, root.line) == (BAD_ROW.path, 3)
    assert summarize(from_task).endswith("empty prompt (in raise_in_task)")

    from_actor = raised_by(FailingActor.remote().ping.remote())
    assert isinstance(from_actor, ActorDiedError)
    assert summarize(from_actor) == (
        "HookError: rollout.custom_rm_path: cannot import 'myreward' (in FailingActor.__init__)"
    )
    assert exit_code(from_actor) == 2

    nested = raised_by(call_failing_actor.remote())
    assert type(root_cause(nested)) is HookError
    assert summarize(nested) == summarize(from_actor)
