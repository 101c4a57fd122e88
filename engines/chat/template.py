"""OpenAI chat messages to the prompt token ids a model sees, through its own chat template.

Both sides that turn messages into tokens, the engine's `/v1/chat/completions` and the
rollout's agent gateway, render through this one function, so a prompt the gateway builds
is token for token the prompt the engine would have built from the same messages. Messages
are normalised as SGLang does before its template runs: text content parts are joined and a
tool call's JSON `arguments` string becomes a dict, which is what HF templates iterate over.
"""

from __future__ import annotations

import json
from typing import Any

_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _content_text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"{where}.content[{i}] is a {kind!r} part: only text parts are "
                                 "supported by this engine")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ValueError(f"{where}.content must be a string, a list of text parts or null")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{i}].function.name is missing")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{where}.tool_calls[{i}].function.arguments is not JSON: {err}"
                ) from err
        out.append({**call, "function": {"name": fn["name"], "arguments": args or {}}})
    return out


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages as HF chat templates expect them; errors name the message and field."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object")
        role = message.get("role")
        if role not in _ROLES:
            raise ValueError(f"{where}.role must be one of {list(_ROLES)}, got {role!r}")
        clean: dict[str, Any] = {"role": role, "content": _content_text(message.get("content"),
                                                                          where)}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if message.get(key) is not None:
                clean[key] = message[key]
        if message.get("tool_calls"):
            clean["tool_calls"] = _tool_calls(message["tool_calls"], where)
        if role != "assistant" and clean["content"] is None:
            clean["content"] = ""
        out.append(clean)
    return out


def render_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The chat template's text for normalised `messages`."""
    if not getattr(tokenizer, "chat_template", None):
        path = getattr(tokenizer, "name_or_path", "") or "this model"
        raise ValueError(f"the tokenizer of {path} has no chat_template: use /v1/completions")
    text = tokenizer.apply_chat_template(
        messages,
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt and not continue_final_message,
        continue_final_message=continue_final_message,
        **(chat_template_kwargs or {}),
    )
    return str(text)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of template text: its special tokens are already in it, none are added."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_prompt_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt token ids of a chat request, as the engine generates from them."""
    text = render_text(tokenizer, messages, tools, True, continue_final_message,
                       chat_template_kwargs)
    return encode_text(tokenizer, text)
