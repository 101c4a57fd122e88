"""The bodies SGLang's OpenAI-compatible server writes, as pure functions of a finished request.

Field names and shapes follow SGLang's `entrypoints/openai/protocol.py`: a chat choice has
`message` (`content`, `tool_calls`), `logprobs.content[]` (`token`, `bytes`, `logprob`,
`top_logprobs`), `finish_reason` (`stop`, `length`, `tool_calls`, `abort`), `matched_stop`,
and, when asked (`return_token_ids`, `return_prompt_token_ids`), `token_ids` and
`prompt_token_ids`; errors are `{"object": "error", "message", "type", "param", "code"}`.
Each log-prob entry also carries its `token_id`, as newer SGLang does, so a client can check
the ids without detokenizing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from engines.chat.tool_calls import ToolCall, tool_call_dicts

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}


def error_body(message: str, status: int = 400, param: str | None = None) -> dict[str, Any]:
    return {"object": "error", "message": message,
            "type": _ERROR_TYPES.get(status, "InternalServerError"), "param": param,
            "code": status}


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished request, as the engine or the gateway saw it."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: dict[str, Any]  # SGLang's meta_info.finish_reason


def finish_reason(sglang: dict[str, Any], has_tool_calls: bool) -> tuple[str, Any]:
    """(OpenAI finish_reason, matched_stop) from SGLang's `{"type", "matched"}`."""
    kind = str(sglang.get("type") or "stop")
    if kind == "stop" and has_tool_calls:
        kind = "tool_calls"
    return kind, sglang.get("matched")


def token_logprobs(tokenizer: Any, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    texts = tokenizer.batch_decode([[i] for i in ids]) if ids else []
    return [
        {"token": t, "bytes": list(t.encode("utf-8")), "logprob": lp, "top_logprobs": [],
         "token_id": i}
        for t, lp, i in zip(texts, logprobs, ids, strict=True)
    ]


def chat_choice(
    index: int,
    done: Finished,
    content: str | None,
    calls: list[ToolCall],
    tokenizer: Any,
    logprobs: bool,
    return_token_ids: bool,
    return_prompt_token_ids: bool,
) -> dict[str, Any]:
    reason, matched = finish_reason(done.finish_reason, bool(calls))
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else ""),
                               "reasoning_content": None,
                               "tool_calls": tool_call_dicts(calls, done.request_id) or None}
    choice: dict[str, Any] = {
        "index": index, "message": message,
        "logprobs": {"content": token_logprobs(tokenizer, done.output_ids,
                                               done.output_logprobs)} if logprobs else None,
        "finish_reason": reason, "matched_stop": matched,
    }
    if return_prompt_token_ids:
        choice["prompt_token_ids"] = done.prompt_ids
    if return_token_ids:
        choice["token_ids"] = done.output_ids
    return choice


def completion_choice(
    index: int, done: Finished, tokenizer: Any, logprobs: bool, return_token_ids: bool,
    echo_text: str | None = None,
) -> dict[str, Any]:
    """A `/v1/completions` choice; `logprobs` has the legacy (`tokens`, `token_logprobs`) shape."""
    reason, matched = finish_reason(done.finish_reason, False)
    choice: dict[str, Any] = {"index": index, "text": (echo_text or "") + done.text,
                              "logprobs": None, "finish_reason": reason,
                              "matched_stop": matched}
    if logprobs:
        tokens = tokenizer.batch_decode([[i] for i in done.output_ids]) if done.output_ids else []
        offsets, at = [], len(echo_text or "")
        for t in tokens:
            offsets.append(at)
            at += len(t)
        choice["logprobs"] = {"text_offset": offsets, "token_logprobs": done.output_logprobs,
                              "tokens": tokens, "top_logprobs": [None] * len(tokens)}
    if return_token_ids:
        choice["token_ids"] = done.output_ids
        choice["prompt_token_ids"] = done.prompt_ids
    return choice


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": None,
            "reasoning_tokens": 0}


def response(
    response_id: str, kind: str, model: str, choices: list[dict[str, Any]],
    prompt_tokens: int, completion_tokens: int,
) -> dict[str, Any]:
    """`kind`: "chat.completion" or "text_completion"."""
    return {"id": response_id, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(prompt_tokens, completion_tokens),
            "metadata": None}


def sse(payload: dict[str, Any] | str) -> bytes:
    body = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {body}\n\n".encode()


def chat_stream_events(body: dict[str, Any], include_usage: bool) -> list[bytes]:
    """A finished chat completion as SGLang's stream: a role delta, the content (and tool
    calls) delta, the finish chunk, the usage chunk when asked, `[DONE]`."""
    head = {"id": body["id"], "object": "chat.completion.chunk", "created": body["created"],
            "model": body["model"]}
    events = []
    for c in body["choices"]:
        i, msg = c["index"], c["message"]
        events.append(sse({**head, "choices": [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None, "matched_stop": None}]}))
        delta: dict[str, Any] = {"content": msg["content"]}
        if msg["tool_calls"]:
            delta["tool_calls"] = msg["tool_calls"]
        events.append(sse({**head, "choices": [
            {"index": i, "delta": delta, "logprobs": c["logprobs"], "finish_reason": None,
             "matched_stop": None}]}))
        events.append(sse({**head, "choices": [
            {"index": i, "delta": {}, "logprobs": None, "finish_reason": c["finish_reason"],
             "matched_stop": c["matched_stop"]}]}))
    if include_usage:
        events.append(sse({**head, "choices": [], "usage": body["usage"]}))
    events.append(sse("[DONE]"))
    return events


def completion_stream_events(body: dict[str, Any], include_usage: bool) -> list[bytes]:
    head = {"id": body["id"], "object": "text_completion", "created": body["created"],
            "model": body["model"]}
    events = [
        sse({**head, "choices": [{"index": c["index"], "text": c["text"],
                                  "logprobs": c["logprobs"], "finish_reason": c["finish_reason"],
                                  "matched_stop": c["matched_stop"]}]})
        for c in body["choices"]
    ]
    if include_usage:
        events.append(sse({**head, "choices": [], "usage": body["usage"]}))
    events.append(sse("[DONE]"))
    return events
