"""SGLang's OpenAI-compatible routes on the embedded engine: `/v1/chat/completions`,
`/v1/completions`, `/v1/models`.

Requests are validated field by field (an unsupported non-default field is a 400 naming it,
never silently ignored), turned into the same `GenRequest`s `/generate` makes and run by the
same scheduler, so an OpenAI client, `/generate` callers and weight updates share one batch.
SGLang's RL extras are honoured: `rid`, `input_ids` (a chat prompt given as token ids
bypasses the template), `return_token_ids`, `return_prompt_token_ids`, `chat_template_kwargs`,
`continue_final_message`, `top_k`, `stop_token_ids`, `ignore_eos`, `no_stop_trim`,
`skip_special_tokens`. `stream: true` answers SGLang's event stream once the request has
finished (the scheduler hands back whole results), not token by token.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engines.chat import openai_shapes as shapes
from engines.chat.template import normalise_messages, render_prompt_ids
from engines.chat.tool_calls import check_parser, offered_tool_names, parse_tool_calls
from engines.inference.gen_types import Generator, GenRequest, GenResult
from engines.inference.sglang_protocol import json_body, json_response, parse_sampling_params

Run = Callable[[list[GenRequest]], Awaitable[list[GenResult]]]

# Fields accepted only at their OpenAI/SGLang default: anything else is refused by name.
_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": None,
    "response_format": None, "regex": None, "ebnf": None, "json_schema": None,
    "min_p": 0.0, "min_tokens": 0, "repetition_penalty": 1.0, "stop_regex": None,
    "lora_path": None, "return_hidden_states": False, "best_of": None, "suffix": None,
    "custom_logit_processor": None, "top_logprobs": 0,
}
_DEFAULT_MAX_TOKENS = 1024


def _check_neutral(body: dict[str, Any]) -> None:
    for key, neutral in _NEUTRAL.items():
        value = body.get(key)
        if value is None or value == neutral:
            continue
        if key == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        raise ValueError(f"{key}={value!r} is not supported by this engine")


def _int(body: dict[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value


def _sampling(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    """The request's sampling fields as SGLang's `sampling_params` dict."""
    params = {
        "max_new_tokens": max_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "stop": body.get("stop"),
        "stop_token_ids": body.get("stop_token_ids"),
        "ignore_eos": body.get("ignore_eos"),
        "no_stop_trim": body.get("no_stop_trim"),
        "skip_special_tokens": body.get("skip_special_tokens"),
        "sampling_seed": body.get("seed"),
    }
    return {k: v for k, v in params.items() if v is not None}


def _requests(
    body: dict[str, Any], prompts: list[list[int]], context_len: int | None
) -> list[GenRequest]:
    """n requests per prompt; rids from `rid` (suffixed per choice), seeds `seed + choice`."""
    n = _int(body, "n", 1) or 1
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise ValueError("rid must be a string")
    base = rid or uuid.uuid4().hex
    requests = []
    for p, ids in enumerate(prompts):
        room = (context_len - len(ids)) if context_len else _DEFAULT_MAX_TOKENS
        if room <= 0:
            raise ValueError(f"the prompt has {len(ids)} tokens, the context {context_len}")
        asked = _int(body, "max_completion_tokens", None) or _int(body, "max_tokens", None)
        if asked is not None and asked <= 0:
            raise ValueError("max_tokens must be positive")
        sampling = _sampling(body, min(asked or _DEFAULT_MAX_TOKENS, room))
        for c in range(n):
            seeded = dict(sampling)
            if "sampling_seed" in seeded:
                seeded["sampling_seed"] = int(seeded["sampling_seed"]) + c
            one = base if len(prompts) * n == 1 else f"{base}-{p * n + c}"
            requests.append(GenRequest(one, list(ids), parse_sampling_params(seeded)))
    return requests


def _finished(r: GenResult, prompt: list[int]) -> shapes.Finished:
    return shapes.Finished(r.rid, prompt, r.output_ids, r.output_logprobs, r.text,
                           r.finish_reason)


def _chat_prompt(body: dict[str, Any], tokenizer: Any, vocab: int) -> list[int]:
    ids = body.get("input_ids")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(
                isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise ValueError(f"input_ids must be a non-empty list of token ids in [0, {vocab})")
        return list(ids)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be an object")
    return render_prompt_ids(tokenizer, normalise_messages(body.get("messages")),
                             body.get("tools"), bool(body.get("continue_final_message")), kwargs)


def _completion_prompts(body: dict[str, Any], tokenizer: Any) -> list[list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [list(tokenizer.encode(prompt))]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [list(tokenizer.encode(p)) for p in prompt]
        if all(isinstance(i, int) for i in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(i, int) for i in p) for p in prompt):
            return [list(p) for p in prompt]
    raise ValueError("prompt must be a string, a list of strings, token ids or lists of them")


def add_openai_routes(
    app: FastAPI, generator: Generator, run: Run, served_model_name: str,
    tool_call_parser: str | None = "hermes",
) -> None:
    check_parser(tool_call_parser)
    tokenizer: Any = getattr(generator, "tokenizer", None)
    context_len = getattr(generator, "context_len", None)

    def answer(body: dict[str, Any], streamed: Callable[..., list[bytes]]) -> Response:
        if body.pop("_stream", False):
            events = streamed(body, body.pop("_include_usage", False))
            return StreamingResponse(iter(events), media_type="text/event-stream")
        return json_response(body)

    async def parsed(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        _check_neutral(body)
        if tokenizer is None:
            raise ValueError("this engine has no tokenizer: use /generate with input_ids")
        return body

    def error(err: Exception) -> Response:
        return json_response_status(shapes.error_body(str(err)), 400)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": served_model_name, "object": "model", "created": 0, "owned_by": "sglang",
                "root": served_model_name, "parent": None, "max_model_len": context_len}
        return json_response({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = await parsed(request)
            prompt = _chat_prompt(body, tokenizer, generator.vocab_size)
            names = offered_tool_names(body.get("tools"), body.get("tool_choice", "auto"))
            requests = _requests(body, [prompt], context_len)
        except ValueError as err:
            return error(err)
        results = await run(requests)
        choices, completion = [], 0
        for i, r in enumerate(results):
            content, calls = (parse_tool_calls(r.text, names)
                              if names and tool_call_parser else (r.text, []))
            choices.append(shapes.chat_choice(
                i, _finished(r, prompt), content, calls, tokenizer, bool(body.get("logprobs")),
                bool(body.get("return_token_ids")), bool(body.get("return_prompt_token_ids"))))
            completion += len(r.output_ids)
        out = shapes.response(f"chatcmpl-{requests[0].rid}", "chat.completion",
                              str(body.get("model") or served_model_name), choices,
                              len(prompt), completion)
        return answer(_stream_flags(out, body), shapes.chat_stream_events)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            body = await parsed(request)
            prompts = _completion_prompts(body, tokenizer)
            requests = _requests(body, prompts, context_len)
            logprobs = _int(body, "logprobs", None)
            if logprobs:
                raise ValueError(f"logprobs={logprobs} asks for top log-probs, which this "
                                 "engine does not compute: use logprobs=0")
        except ValueError as err:
            return error(err)
        results = await run(requests)
        n = len(results) // len(prompts)
        choices = [
            shapes.completion_choice(
                i, _finished(r, prompts[i // n]), tokenizer, logprobs is not None,
                bool(body.get("return_token_ids")),
                tokenizer.decode(prompts[i // n]) if body.get("echo") else None)
            for i, r in enumerate(results)
        ]
        out = shapes.response(f"cmpl-{requests[0].rid}", "text_completion",
                              str(body.get("model") or served_model_name), choices,
                              sum(len(p) for p in prompts),
                              sum(len(r.output_ids) for r in results))
        return answer(_stream_flags(out, body), shapes.completion_stream_events)


def _stream_flags(out: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    if body.get("stream"):
        options = body.get("stream_options") or {}
        out["_stream"], out["_include_usage"] = True, bool(options.get("include_usage"))
    return out


def json_response_status(content: Any, status: int) -> Response:
    response = json_response(content)
    response.status_code = status
    return response
