"""An agent written with the official `openai` client (examples/openai_agent/agent.py),
trained by GRPO through the train flow: embedded engine, torch trainer, real Ray and Prefect.

The model is the example's tiny one taught by heart to call the calculator for "what is
2+3?" and answer after its result (tests/support/agent_model.py); sampled at temperature 1
it sometimes strays, so groups have both rewards. Every model token of every trained sample
must be the engine's, with its log-prob and loss mask 1; every other token loss mask 0 and
log-prob 0; and a kill -9 of the driver mid-run, then the same command, must train the
same samples (tokens, loss masks, rewards) as an uninterrupted run.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from tests.support.agent_model import taught_agent_model
from tests.support.agent_runs import (
    assert_every_step_without_drift,
    assert_kill_and_rerun_trains_the_same,
    assert_step_0_turns_are_the_engines,
    train_three_steps,
)
from tests.support.configs import arithmetic_config


@pytest.fixture(scope="module")
def agent_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return taught_agent_model(str(tmp_path_factory.mktemp("agent") / "taught"))


@pytest.fixture(scope="module")
def questions(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("data") / "questions.jsonl"
    path.write_text("".join(json.dumps({"prompt": "2+3=", "label": "5"}) + "\n"
                            for _ in range(8)))
    return str(path)


def config(name: str, agent_model: str, questions: str, tmp_path: Any, ray_address: str) -> Any:
    return arithmetic_config(
        run_name=f"{name}-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
        data={"train": questions}, model_dir=agent_model, ray_address=ray_address,
        backend="embedded",
        overrides=["rollout.agent_path=examples.openai_agent.agent:run_agent",
                   "rollout.rm_type=null", "rollout.max_response_len=160",
                   "rollout.rollout_batch_size=2", "rollout.num_rollout=3",
                   "rollout.use_router=false", "cluster.keep_actors=true"],
    )




def test_openai_agent_trains_with_exact_tokens_and_resumes_after_kill(
    prefect_api: str, ray_address: str, agent_model: str, questions: str, tmp_path: Any
) -> None:
    reference = config("agent", agent_model, questions, tmp_path, ray_address)
    layout, samples = train_three_steps(reference)
    rewards = [s.reward for s in samples]
    assert set(rewards) == {0.0, 1.0}, rewards  # the policy gradient is not zero
    assert all(s.metadata["agent_turns"] >= 1 for s in samples)
    assert any(s.metadata["agent_turns"] == 2 for s in samples)  # called the tool, answered
    assert_every_step_without_drift(layout)

    assert_step_0_turns_are_the_engines(layout, agent_model, reference.rollout.seed)

    # kill -9 of the driver once step 0 committed, then the same command
    cfg = config("agent-kill", agent_model, questions, tmp_path, ray_address)
    assert_kill_and_rerun_trains_the_same(cfg, tmp_path, prefect_api, samples)
