"""The agent gateway: an `openai`-client agent's calls become one sample with exact tokens.

The engine is the embedded one in-process, serving the tiny model taught to call the
calculator for "what is 2+3?" (tests/support/agent_model.py); the agent is the example's
(examples/openai_agent/agent.py), unchanged. Every model token must be the engine's output
for the prompt the gateway sent, with the engine's log-prob and loss mask 1; every other
token loss mask 0; and the sample must be the conversation's own rendering, never a
re-tokenization of generated text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from openai import AsyncOpenAI

from engines.chat.template import encode_text, normalise_messages, render_text
from engines.inference.engine_actor import EngineActor
from engines.rollout.agent_gateway import SEED_STRIDE, AgentGateway
from examples.openai_agent.agent import CALCULATOR, run_agent
from flows.config.run import EngineConfig
from storage.sample import Sample, Status
from tests.support.agent_model import taught_agent_model


def make_sample(index: int, prompt: str, label: str) -> Sample:
    """A fresh sample as the data source hands it out (its prompt ids are replaced by the
    agent's first request)."""
    return Sample(index=index, group_index=index, prompt=prompt, label=label, tokens=[1, 2])


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineActor]:
    model_dir = taught_agent_model(str(tmp_path_factory.mktemp("gateway") / "taught"))
    threads = torch.get_num_threads()
    actor = EngineActor(EngineConfig(backend="embedded", model_path=model_dir), 0, num_threads=1)
    yield actor
    actor.shutdown()
    torch.set_num_threads(threads)


def params(temperature: float, budget: int = 200, seed: int = 11) -> dict[str, Any]:
    return {"temperature": temperature, "top_p": 1.0, "top_k": -1, "max_new_tokens": budget,
            "stop": [], "skip_special_tokens": True, "no_stop_trim": False,
            "sampling_seed": seed}


def run(engine: EngineActor, agent: Any, sample: Sample, sampling: dict[str, Any]) -> Sample:
    async def go() -> Sample:
        args = SimpleNamespace(engine_url=engine.url())
        gateway = AgentGateway(args, engine.generator.tokenizer)  # type: ignore[attr-defined]
        await gateway.start()
        try:
            return await gateway.run_sample(agent, sample, sampling)
        finally:
            await gateway.stop()
    return asyncio.run(go())


def model_turns(sample: Sample) -> list[tuple[int, int]]:
    """(start, end) in `sample.tokens` of each run of loss-mask-1 tokens."""
    runs, start = [], None
    offset = sample.prompt_length
    for i, m in enumerate([*sample.loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((offset + start, offset + i))
            start = None
    return runs


def check_against_engine(engine: EngineActor, sample: Sample, sampling: dict[str, Any]) -> None:
    """Each model turn is what /generate gives for the tokens before it, with its seed."""
    lp_at = {sample.prompt_length + i: lp for i, lp in enumerate(sample.rollout_log_probs)}
    for turn, (start, end) in enumerate(model_turns(sample)):
        body = {"input_ids": sample.tokens[:start], "return_logprob": True,
                "sampling_params": {**sampling, "max_new_tokens": end - start,
                                    "sampling_seed": sampling["sampling_seed"] + SEED_STRIDE * turn}}
        native = httpx.post(engine.url() + "/generate", json=body).json()
        assert native["output_ids"] == sample.tokens[start:end]
        assert [x[0] for x in native["meta_info"]["output_token_logprobs"]] == [
            lp_at[i] for i in range(start, end)]
    masked = [lp for lp, m in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if not m]
    assert masked == [0.0] * len(masked)


def test_the_taught_agent_calls_the_tool_and_answers(engine: EngineActor) -> None:
    sample = make_sample(0, prompt="2+3=", label="5")
    out = run(engine, run_agent, sample, params(0.0))
    assert out.reward == 1.0 and out.status == Status.COMPLETED
    assert out.metadata["agent_turns"] == 2
    tok = engine.generator.tokenizer  # type: ignore[attr-defined]
    conversation = normalise_messages([
        {"role": "user", "content": "what is 2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "the answer is 5"}])
    rendered = encode_text(tok, render_text(tok, conversation, [CALCULATOR],
                                            add_generation_prompt=False))
    assert out.tokens == rendered[:-1]  # all but the template's newline after the last <eos>
    assert len(model_turns(out)) == 2
    check_against_engine(engine, out, params(0.0))
    assert "token_drift_turns" not in out.metadata
    assert "retokenize_mismatch_turns" not in out.metadata


async def chatty_agent(base_url: str, sample: Sample, api_key: str = "") -> None:
    """Three short turns whatever the model says, passing back the replies as the SDK
    returns them; the reward is left to the reward function (None)."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages: list[Any] = [{"role": "user", "content": "what is 7+8?"}]
        for _ in range(3):
            reply = await client.chat.completions.create(
                model="p", messages=messages, tools=[CALCULATOR], max_tokens=8)  # type: ignore[list-item]
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "again"}]


def test_a_sampling_agent_keeps_every_model_token_exact(engine: EngineActor) -> None:
    """Temperature 1: output a re-tokenization would not always give back (special and
    unknown tokens, broken calls), sampled with each turn's own seed."""
    out = run(engine, chatty_agent, make_sample(1, prompt="7+8=", label="15"),
              params(1.0, budget=120, seed=3))
    assert out.reward is None and out.metadata["agent_turns"] == 3
    assert sum(out.loss_mask) == 24 and len(model_turns(out)) == 3
    assert len(out.loss_mask) == out.response_length <= 120
    check_against_engine(engine, out, params(1.0, budget=120, seed=3))
    assert "token_drift_turns" not in out.metadata


async def forgetful_agent(base_url: str, sample: Sample, api_key: str = "") -> float:
    """Drops its first exchange from the history: the gateway must split, not mix."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        first = [{"role": "user", "content": "what is 2+3?"}]
        await client.chat.completions.create(model="p", messages=first, max_tokens=6)  # type: ignore[arg-type]
        second = [{"role": "user", "content": "what is 4+4?"}]
        await client.chat.completions.create(model="p", messages=second, max_tokens=6)  # type: ignore[arg-type]
    return 0.0


def test_a_rewritten_history_splits_the_sample_and_is_counted(engine: EngineActor) -> None:
    out = run(engine, forgetful_agent, make_sample(2, prompt="1+1=", label="2"), params(0.0))
    assert out.metadata["token_drift_turns"] == 1
    assert out.metadata["token_drift_tokens"] == 6
    tok = engine.generator.tokenizer  # type: ignore[attr-defined]
    second = encode_text(tok, render_text(tok, [{"role": "user", "content": "what is 4+4?"}]))
    assert out.prompt_tokens == second and out.response_length == 6


async def silent_agent(base_url: str, sample: Sample) -> float:
    return 1.0


async def broken_agent(base_url: str, sample: Sample) -> float:
    raise RuntimeError("the agent's own bug")


def test_an_agent_that_never_calls_or_raises_fails_its_sample(engine: EngineActor) -> None:
    silent = run(engine, silent_agent, make_sample(3, prompt="1+1=", label="2"), params(0.0))
    assert silent.status == Status.FAILED and "no chat completion" in silent.metadata["agent_error"]
    broken = run(engine, broken_agent, make_sample(4, prompt="1+1=", label="2"), params(0.0))
    assert broken.status == Status.FAILED and broken.reward == 0.0
    assert "the agent's own bug" in broken.metadata["agent_error"]


def test_an_unknown_session_is_401(engine: EngineActor) -> None:
    async def go() -> int:
        gateway = AgentGateway(SimpleNamespace(engine_url=engine.url()),
                               engine.generator.tokenizer)  # type: ignore[attr-defined]
        await gateway.start()
        try:
            async with httpx.AsyncClient() as c:
                r = await c.post(gateway.base_url("nobody") + "/chat/completions",
                                 json={"messages": [{"role": "user", "content": "hi"}]})
            return r.status_code
        finally:
            await gateway.stop()
    assert asyncio.run(go()) == 401


def test_an_aborted_agent_sample_resumes_from_its_record(engine: EngineActor) -> None:
    """A partial rollout of an agent: the rerun agent's calls are answered from the record
    (turn 1) and the aborted turn continues from its partial output (turn 2), giving the
    uninterrupted trajectory back."""
    whole = run(engine, run_agent, make_sample(5, prompt="2+3=", label="5"), params(0.0))
    record = whole.metadata["agent_record"]
    (_, first_end, *_), (second_start, second_end, *_) = record
    cut = second_start + (second_end - second_start) // 2
    partial = make_sample(5, prompt="2+3=", label="5")
    partial.tokens = whole.tokens[:cut]
    keep = cut - whole.prompt_length
    partial.response_length = keep
    partial.loss_mask = whole.loss_mask[:keep]
    partial.rollout_log_probs = whole.rollout_log_probs[:keep]
    tok = engine.generator.tokenizer  # type: ignore[attr-defined]
    partial.response = tok.decode(partial.response_tokens)
    partial.status = Status.ABORTED
    partial.metadata["agent_record"] = [
        record[0], [second_start, cut, {"type": "abort"}, tok.decode(whole.tokens[second_start:cut]),
                    0]]
    resumed = run(engine, run_agent, partial, params(0.0, budget=200 - keep))
    assert resumed.reward == 1.0 and resumed.status == Status.COMPLETED
    assert resumed.metadata["agent_replayed_turns"] == 2
    assert "agent_replay_mismatch" not in resumed.metadata
    assert resumed.tokens == whole.tokens and resumed.loss_mask == whole.loss_mask
    assert resumed.rollout_log_probs[:keep] == whole.rollout_log_probs[:keep]
    assert resumed.rollout_log_probs == pytest.approx(whole.rollout_log_probs, abs=1e-5)
    assert first_end < second_start


async def other_agent(base_url: str, sample: Sample, api_key: str = "") -> float:
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        await client.chat.completions.create(
            model="p", messages=[{"role": "user", "content": "what is 9+9?"}], max_tokens=4)
    return 0.0


def test_a_rerun_that_asks_otherwise_generates_afresh_and_is_counted(engine: EngineActor) -> None:
    whole = run(engine, run_agent, make_sample(6, prompt="2+3=", label="5"), params(0.0))
    whole.status = Status.ABORTED
    out = run(engine, other_agent, whole, params(0.0, budget=200 - whole.response_length))
    assert out.metadata["agent_replay_mismatch"] == 1
    assert out.response_length == 4 and out.loss_mask == [1] * 4
