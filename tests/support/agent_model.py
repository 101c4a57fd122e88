"""A tiny agent model that has learned by heart what to answer, for tests that need a model
to write a tool call (an untrained one never writes valid JSON): the example's tiny model
taught two replies with `examples.openai_agent.model.teach`.
"""

from __future__ import annotations

from typing import Any

from examples.openai_agent.model import Lesson, save_agent_model, teach

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "calculator", "parameters": {}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
LESSONS: list[Lesson] = [
    ([{"role": "user", "content": "what is 2+3?"}], CALL),
    ([{"role": "user", "content": "what is 2+3?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
      {"role": "tool", "content": "5"}], "the answer is 5"),
]


def taught_agent_model(out_dir: str) -> str:
    return teach(save_agent_model(out_dir + "-random"), out_dir, LESSONS, TOOLS)
