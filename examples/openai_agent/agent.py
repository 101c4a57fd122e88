"""An agent written against the official `openai` client, trained unchanged by rollflow
(`rollout.agent_path: examples.openai_agent.agent:run_agent`).

```
 user: what is 35+50?      ──► chat.completions.create(tools=[calculator])
 assistant: <tool_call>…   ◄── finish_reason "tool_calls": run the calculator,
 tool: 85                  ──►   append its result, ask again
 assistant: 85             ◄── an answer: reward 1 if it is the label, else
 user: wrong, try again    ──►   one more try (MAX_TURNS turns in all)
```
It knows nothing of tokens: rollflow hands it a base URL of the agent gateway, which records
the exact token ids and log-probs of every call. Run outside training it talks to any
OpenAI-compatible server (`rollflow engine`, SGLang, vLLM): `python -m
examples.openai_agent.agent --base-url http://127.0.0.1:30000/v1 --question "what is 2+3?"`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from typing import Any

from openai import AsyncOpenAI

from examples.tool_agent.calculator import CalculatorError, evaluate

MAX_TURNS = 4
MAX_TOKENS_PER_TURN = 96  # a tool call is ~75 characters of the tiny model
RETRY = "wrong, try again"
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
_NUMBER = re.compile(r"-?\d+")


def tool_result(arguments: str) -> str:
    try:
        return evaluate(str(json.loads(arguments).get("expression", "")))
    except (json.JSONDecodeError, AttributeError, CalculatorError):
        return "error"


def final_answer(content: str | None) -> str | None:
    numbers = _NUMBER.findall(content or "")
    return numbers[-1] if numbers else None


async def solve(client: AsyncOpenAI, question: str, label: str | None,
                model: str = "policy") -> tuple[float, list[dict[str, Any]]]:
    """(reward, the conversation): 1.0 once an answer equals `label`."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for turn in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model=model, messages=messages, tools=[CALCULATOR],  # type: ignore[arg-type, list-item]
            max_tokens=MAX_TOKENS_PER_TURN,
        )
        choice = reply.choices[0]
        messages.append(choice.message.model_dump(exclude_none=True))
        if choice.finish_reason == "tool_calls":
            for call in choice.message.tool_calls or []:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": tool_result(call.function.arguments)})  # type: ignore[union-attr]
            continue
        if choice.finish_reason != "stop":  # length (budget spent) or abort (end of step)
            break
        if label is not None and final_answer(choice.message.content) == label:
            return 1.0, messages
        if turn < MAX_TURNS - 1:
            messages.append({"role": "user", "content": RETRY})
    return 0.0, messages


def question_of(prompt: Any) -> str:
    """The dataset's prompt (`35+50=` in the arithmetic data) as a question."""
    if isinstance(prompt, list):  # chat messages: the last user turn
        return str(prompt[-1]["content"])
    return f"what is {str(prompt).rstrip('=? ')}?"


async def run_agent(base_url: str, sample: Any, api_key: str = "unused", **_: Any) -> float:
    """The rollout's agent: its return is the sample's reward."""
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        reward, _messages = await solve(client, question_of(sample.prompt), sample.label)
    return reward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--question", default="what is 2+3?")
    parser.add_argument("--label", default=None)
    args = parser.parse_args()

    async def go() -> None:
        async with AsyncOpenAI(base_url=args.base_url, api_key="none") as client:
            models = await client.models.list()
            reward, messages = await solve(client, args.question, args.label, models.data[0].id)
        for m in messages:
            print(m)
        print("reward", reward)

    asyncio.run(go())


if __name__ == "__main__":
    main()
