"""Tool calls out of generated text, in the Hermes / Qwen2.5 format SGLang's `qwen25` parser
reads: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them.

A block that is not valid JSON, or names a tool the request did not offer, stays in the
content as text (SGLang drops unknown names; keeping the text loses nothing the model wrote).
Call ids are derived from the request id, so a replayed request gets the same ids and an
agent that echoes them builds the same next prompt.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Collection
from dataclasses import dataclass

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
TOOL_CALL_PARSERS = ("hermes", "qwen25", "qwen")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


def check_parser(name: str | None) -> None:
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser {name!r} is not known (known: {TOOL_CALL_PARSERS})")


def parse_tool_calls(text: str, tool_names: Collection[str]) -> tuple[str, list[ToolCall]]:
    """(content without the parsed blocks, the calls in order)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _BLOCK.finditer(text):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        name = body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str) or name not in tool_names:
            continue
        args = body.get("arguments", body.get("parameters", {}))
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(ToolCall(name, args if isinstance(args, str) else json.dumps(args)))
    kept.append(text[last:])
    return "".join(kept).strip() if calls else text, calls


def call_id(request_id: str, index: int) -> str:
    digest = hashlib.sha256(f"{request_id}/{index}".encode()).hexdigest()[:24]
    return f"call_{digest}"


def tool_call_dicts(calls: list[ToolCall], request_id: str) -> list[dict[str, object]]:
    """OpenAI's `message.tool_calls` entries (SGLang adds `index`)."""
    return [
        {"id": call_id(request_id, i), "index": i, "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for i, c in enumerate(calls)
    ]


def offered_tool_names(tools: object, tool_choice: object) -> set[str]:
    """The function names a request offers the model (`tool_choice: none` offers none)."""
    if not tools or tool_choice == "none":
        return set()
    if not isinstance(tools, list):
        raise ValueError("tools must be a list")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tools[{i}].function.name is missing")
        names.add(fn["name"])
    if isinstance(tool_choice, dict):
        chosen = (tool_choice.get("function") or {}).get("name")
        if not isinstance(chosen, str) or chosen not in names:
            raise ValueError(f"tool_choice names {chosen!r}, which is not in tools")
        return {chosen}
    return names
