"""A multi-turn verifiers environment trained by GRPO through `rollflow train`
(`rollout.environment: verifiers://...`): embedded engine, torch trainer, real Ray and Prefect.

The environment is tests/support/verifiers_envs/sum_retry.py (a wrong reply is answered
"wrong, try again" and asked again); its tasks are the prompts and its rubric the reward. The
model is taught "2+3=" → "4", then "5", with flattened logits so sampled episodes stray
(tests/support/verifiers_envs/model.py). Every model token of every trained sample must be
the engine's, with its log-prob and loss mask 1; every other token loss mask 0 and log-prob 0;
no call may drift from the recorded conversation; and a kill -9 of the driver mid-run, then
the same command, must train the same samples (tokens, loss masks, rewards) as an
uninterrupted run.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.agent_runs import (
    assert_every_step_without_drift,
    assert_kill_and_rerun_trains_the_same,
    assert_step_0_turns_are_the_engines,
    environment_config,
    model_turns,
    train_three_steps,
)

pytest.importorskip("verifiers.v1")  # rollflow[envs]
from tests.support.verifiers_envs.model import taught_sum_retry_model  # noqa: E402

# 2+3= (taught), 1+4=, 3+3=: two turns each unless the first reply is right
URI = "verifiers://tests.support.verifiers_envs.sum_retry?limit=3"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return taught_sum_retry_model(str(tmp_path_factory.mktemp("verifiers") / "taught"))


def config(name: str, model: str, tmp_path: Any, ray_address: str) -> Any:
    return environment_config(name, URI, model, tmp_path, ray_address, max_response_len=40)




def test_verifiers_env_trains_with_exact_tokens_and_resumes_after_kill(
    prefect_api: str, ray_address: str, model: str, tmp_path: Any
) -> None:
    reference = config("verifiers", model, tmp_path, ray_address)
    layout, samples = train_three_steps(reference)
    assert len({s.reward for s in samples}) > 1, [s.reward for s in samples]
    for s in samples:
        env = s.metadata["environment"]
        assert env["uri"] == URI and env["split"] == "train"
        assert s.reward == env["metrics"]["reward/solved"]  # the rubric is the reward
        # a turn past the budget (max_response_len) is answered with no tokens
        assert len(model_turns(s)) <= s.metadata["agent_turns"] == env["metrics"]["turns"]
    assert any(s.metadata["agent_turns"] == 2 for s in samples)  # the environment spoke again
    assert_every_step_without_drift(layout)

    assert_step_0_turns_are_the_engines(layout, model, reference.rollout.seed)

    # kill -9 of the driver once step 0 committed, then the same command
    cfg = config("verifiers-kill", model, tmp_path, ray_address)
    assert_kill_and_rerun_trains_the_same(cfg, tmp_path, prefect_api, samples)
