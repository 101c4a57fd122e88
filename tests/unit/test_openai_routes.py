"""The embedded engine's OpenAI-compatible routes, driven by the official `openai` client.

The model is the agent example's tiny model taught by heart to call the calculator for
"what is 2+3?" and to answer after the tool's result (tests/support/agent_model.py), so the
tool-call parser, finish reasons, token ids and log-probs are checked on a real forward.
Shapes are checked against the fields of SGLang's protocol (`ChatCompletionResponseChoice`,
`ChatCompletionTokenLogprob`, `ModelCard`, `ErrorResponse`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from engines.chat.template import encode_text, normalise_messages, render_text
from engines.inference.engine_actor import EngineActor
from tests.support.agent_model import CALL, LESSONS, TOOLS, taught_agent_model
from tests.support.engines import embedded_engine

SGLANG_CHAT_CHOICE = {"index", "message", "logprobs", "finish_reason", "matched_stop",
                      "hidden_states", "prompt_token_ids", "token_ids", "meta_info"}
SGLANG_TOKEN_LOGPROB = {"token", "bytes", "logprob", "top_logprobs", "token_id"}
SGLANG_ERROR = {"object", "message", "type", "param", "code"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return taught_agent_model(str(tmp_path_factory.mktemp("openai") / "taught"))


@pytest.fixture(scope="module")
def engine(model_dir: str) -> Iterator[EngineActor]:
    with embedded_engine(model_dir) as actor:
        yield actor


@pytest.fixture()
def client(engine: EngineActor) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.url() + "/v1", api_key="none", max_retries=0)


def first_turn(**extra: object) -> dict[str, object]:
    return {"model": "policy", "messages": LESSONS[0][0], "tools": TOOLS, "temperature": 0.0,
            **extra}


def test_models_lists_the_served_model(client: openai.OpenAI, model_dir: str) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [model_dir]
    assert models.data[0].model_extra == {"root": model_dir, "parent": None,
                                          "max_model_len": 512}


def test_chat_parses_the_tool_call_with_token_ids_and_logprobs(
    client: openai.OpenAI, engine: EngineActor
) -> None:
    reply = client.chat.completions.create(
        **first_turn(logprobs=True),  # type: ignore[arg-type]
        extra_body={"return_token_ids": True, "return_prompt_token_ids": True, "rid": "t1"},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [  # type: ignore[union-attr]
        ("calculator", {"expression": "2+3"})]
    assert calls[0].id.startswith("call_")
    extra = choice.model_extra or {}
    tokenizer = engine.generator.tokenizer  # type: ignore[attr-defined]
    prompt = encode_text(tokenizer, render_text(tokenizer, normalise_messages(LESSONS[0][0]),
                                                TOOLS))
    assert extra["prompt_token_ids"] == prompt
    assert extra["token_ids"] == encode_text(tokenizer, CALL) + [tokenizer.eos_token_id]
    entries = choice.logprobs.content  # type: ignore[union-attr]
    assert [e.model_extra["token_id"] for e in entries] == extra["token_ids"]  # type: ignore[index]
    # the same prompt through SGLang's native /generate: the same tokens and log-probs
    native = httpx.post(engine.url() + "/generate", json={
        "input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": 1024},
        "return_logprob": True}).json()
    assert native["output_ids"] == extra["token_ids"]
    assert [e.logprob for e in entries] == [lp for lp, _, _ in
                                            native["meta_info"]["output_token_logprobs"]]
    assert reply.usage.prompt_tokens == len(prompt)  # type: ignore[union-attr]
    assert reply.usage.completion_tokens == len(extra["token_ids"])  # type: ignore[union-attr]
    raw = httpx.post(engine.url() + "/v1/chat/completions",
                     json=first_turn(logprobs=True, return_token_ids=True)).json()
    assert set(raw["choices"][0]) <= SGLANG_CHAT_CHOICE
    assert set(raw["choices"][0]["logprobs"]["content"][0]) == SGLANG_TOKEN_LOGPROB
    assert raw["object"] == "chat.completion" and raw["id"].startswith("chatcmpl-")


def test_the_tool_result_turn_answers_and_stops(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="policy", messages=LESSONS[1][0],  # type: ignore[arg-type]
                                           tools=TOOLS, temperature=0.0)  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == LESSONS[1][1]
    assert reply.choices[0].message.tool_calls is None


def test_tool_choice_none_leaves_the_call_as_text(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(**first_turn(tool_choice="none"))  # type: ignore[arg-type]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == CALL


def test_streaming_chat_delivers_the_same_completion(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        **first_turn(stream=True, stream_options={"include_usage": True})))  # type: ignore[arg-type]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [c.function.name for c in calls] == ["calculator"]  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_completions_with_logprobs_and_n(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="policy", prompt="1+1=", max_tokens=4, n=2,
                                      temperature=1.0, seed=5, logprobs=0)
    assert len(reply.choices) == 2
    for choice in reply.choices:
        assert choice.finish_reason in ("stop", "length")
        assert len(choice.logprobs.token_logprobs) == len(choice.logprobs.tokens)  # type: ignore[union-attr, arg-type]
        assert "".join(choice.logprobs.tokens) == choice.text  # type: ignore[union-attr, arg-type]
    again = client.completions.create(model="policy", prompt="1+1=", max_tokens=4, n=2,
                                      temperature=1.0, seed=5)
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]


@pytest.mark.parametrize(("extra", "named"), [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
])
def test_bad_requests_are_400_naming_the_field(
    client: openai.OpenAI, engine: EngineActor, extra: dict[str, object], named: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=named.replace("[", r"\[")):
        client.chat.completions.create(**{**first_turn(), **extra})  # type: ignore[arg-type]
    raw = httpx.post(engine.url() + "/v1/chat/completions", json={**first_turn(), **extra})
    assert raw.status_code == 400 and set(raw.json()) == SGLANG_ERROR
