"""A multi-turn verifiers environment's episodes through rollflow's agent gateway, on the
embedded engine: verifiers runs the episode (its Env, interaction, interception and rubric),
every model call goes through the sample's gateway URL, and the sample is the exact tokens.

The environment is `tests/support/verifiers_envs/sum_retry.py` (a wrong reply is answered
"wrong, try again"); the model is taught to answer "2+3=" with "4", then "5"
(tests/support/verifiers_envs/model.py). Each model turn must be what the engine's /generate
gives for the tokens before it with that turn's seed; no call may drift from the recorded
conversation; and the same task, seed and sampling must give the same sample again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from engines.environments.base import METADATA_KEY
from engines.environments.registry import close_environments, open_environment
from engines.environments.rows import environment_agent
from engines.inference.engine_actor import EngineActor
from engines.rollout.agent_gateway import SEED_STRIDE, AgentGateway
from flows.config.run import EngineConfig
from storage.sample import Sample, Status
from tests.support.agent_runs import model_turns

pytest.importorskip("verifiers.v1")  # rollflow[envs]
from tests.support.verifiers_envs.model import taught_sum_retry_model  # noqa: E402

URI = "verifiers://tests.support.verifiers_envs.sum_retry?limit=3"  # 2+3= (taught), 1+4=, 3+3=


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineActor]:
    model_dir = taught_sum_retry_model(str(tmp_path_factory.mktemp("verifiers") / "taught"))
    threads = torch.get_num_threads()
    actor = EngineActor(EngineConfig(backend="embedded", model_path=model_dir), 0, num_threads=1)
    yield actor
    actor.shutdown()
    torch.set_num_threads(threads)
    close_environments()


def params(temperature: float, seed: int) -> dict[str, Any]:
    return {"temperature": temperature, "top_p": 1.0, "top_k": -1, "max_new_tokens": 60,
            "stop": [], "skip_special_tokens": True, "no_stop_trim": False,
            "sampling_seed": seed}


def episodes(engine: EngineActor, samples: list[Sample], sampling: dict[str, Any]
             ) -> tuple[list[Sample], list[dict[str, float]]]:
    """Each sample's episode as the rollout runs it: `rollout.environment`'s agent in a
    gateway session, each sample with its own seed; (samples, their episode metrics)."""
    async def go() -> list[Sample]:
        gateway = AgentGateway(SimpleNamespace(engine_url=engine.url()),
                               engine.generator.tokenizer)  # type: ignore[attr-defined]
        await gateway.start()
        try:
            return list(await asyncio.gather(
                *(gateway.run_sample(environment_agent(URI), s, {
                    **sampling, "sampling_seed": sampling["sampling_seed"] + s.index})
                  for s in samples)))
        finally:
            await gateway.stop()
    done = asyncio.run(go())
    return done, [s.metadata[METADATA_KEY]["metrics"] for s in done]


def fresh(n: int) -> list[Sample]:
    """Samples of the environment's tasks in turn, with the metadata its rows give them."""
    tasks = open_environment(URI).tasks("train")
    return [Sample(index=i, group_index=i % len(tasks), prompt=tasks[i % len(tasks)].prompt,
                   tokens=[1], metadata={METADATA_KEY: {
                       "uri": URI, "split": "train", "index": i % len(tasks),
                       "task": tasks[i % len(tasks)].to_json()}})
            for i in range(n)]



def assert_engine_tokens(engine: EngineActor, sample: Sample, sampling: dict[str, Any]) -> None:
    lp_at = {sample.prompt_length + i: lp for i, lp in enumerate(sample.rollout_log_probs)}
    for turn, (start, end) in enumerate(model_turns(sample)):
        body = {"input_ids": sample.tokens[:start], "return_logprob": True,
                "sampling_params": {**sampling, "max_new_tokens": end - start,
                                    "sampling_seed": sampling["sampling_seed"] + sample.index
                                    + SEED_STRIDE * turn}}
        native = httpx.post(engine.url() + "/generate", json=body, timeout=60).json()
        assert native["output_ids"] == sample.tokens[start:end]
        # concurrent samples share the engine's batches, which move log-probs in the 7th digit
        assert [x[0] for x in native["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [lp_at[i] for i in range(start, end)], abs=1e-4)
    masked = [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if not m]
    assert masked == [0.0] * len(masked)


def test_a_greedy_episode_is_two_turns_of_exact_tokens(engine: EngineActor) -> None:
    sampling = params(0.0, seed=5)
    (sample,), (result,) = episodes(engine, fresh(1), sampling)
    tok = engine.generator.tokenizer  # type: ignore[attr-defined]
    assert sample.status == Status.COMPLETED, sample.metadata
    assert sample.metadata["agent_turns"] == 2
    assert tok.decode(sample.tokens) == (
        "user: 2+3=<eos>\nassistant: 4<eos>\nuser: wrong, try again<eos>\nassistant: 5<eos>")
    assert sample.reward == 0.5  # the rubric: right on the second try
    assert result == {"reward/solved": 0.5, "metric/tries": 2.0, "turns": 2.0}
    assert len(model_turns(sample)) == 2
    assert_engine_tokens(engine, sample, sampling)
    assert "token_drift_turns" not in sample.metadata
    assert "retokenize_mismatch_turns" not in sample.metadata


def test_sampled_episodes_are_exact_and_the_same_again(engine: EngineActor) -> None:
    sampling = params(1.0, seed=17)
    first, results = episodes(engine, fresh(6), sampling)
    for s in first:
        assert s.status == Status.COMPLETED, s.metadata
        assert "token_drift_turns" not in s.metadata
        assert_engine_tokens(engine, s, sampling)
    assert {r["turns"] for r in results} <= {1.0, 2.0}
    again, _ = episodes(engine, fresh(6), sampling)
    assert [(s.tokens, s.loss_mask, s.reward) for s in again] == [
        (s.tokens, s.loss_mask, s.reward) for s in first]
    assert len({(s.reward, len(s.tokens)) for s in first}) > 1  # not one path six times
