"""The harness rollflow runs a verifiers environment's agent in: a plain chat loop, in process.

A verifiers harness is the program the policy plays in; the model calls of every harness go
through verifiers' interception endpoint, which forwards them to rollflow's agent gateway
(one sample's OpenAI endpoint). verifiers' own chat loops (`null`, `bash`) run as a `uv`
script in a subprocess and stream their calls; the gateway answers whole calls only, and a
rollout should not need `uv` or the network, so rollflow plays each seat with this loop
instead: the task's system prompt and prompt (or the conversation so far, when the
environment speaks again), one non-streaming call at a time, the task's MCP tools called
when the model asks for them, until a reply without tool calls. It sends no sampling
parameters: the gateway applies the rollout's.

Imported only when a `verifiers://` environment is opened (it needs verifiers); verifiers
finds it by the harness id `HARNESS_ID` (engines/environments/verifiers_env.py registers it).
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import verifiers.v1 as vf
from openai import APIError, AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

HARNESS_ID = "rollflow_gateway_chat"


class GatewayChatConfig(vf.HarnessConfig):
    """No knobs: the rollout's config decides sampling and budget."""


class GatewayChatHarness(vf.Harness[GatewayChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True  # stateless: a later segment relaunches on the conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(m) for m in prompt)
        try:
            async with AsyncExitStack() as stack:
                client = await stack.enter_async_context(
                    AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0))
                tools, dispatch, servers = ([], {}, {}) if not mcp_urls else await connect_mcp(
                    {"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                    for name, url in mcp_urls.items()}}, stack)
                await _chat_loop(client, ctx.model, messages, tools, dispatch, servers)
        except APIError as e:
            # a @stop or a turn limit refuses the call: verifiers reads the trace's stop
            # condition and takes the exit as expected; any other refusal is the harness's error
            return vf.ProgramResult(exit_code=1, stdout="", stderr=f"{type(e).__name__}: {e}")
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def _chat_loop(client: AsyncOpenAI, model: str, messages: list[dict[str, Any]],
                     tools: list[dict[str, Any]], dispatch: dict[str, Any],
                     servers: dict[str, Any]) -> None:
    while True:
        reply = await client.chat.completions.create(
            model=model, messages=messages, **({"tools": tools} if tools else {}))  # type: ignore[call-overload]
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls or reply.choices[0].finish_reason in ("length", "abort"):
            return
        for call in message.tool_calls:
            name = call.function.name  # type: ignore[union-attr]
            try:
                arguments = json.loads(call.function.arguments or "{}")  # type: ignore[union-attr]
            except json.JSONDecodeError as e:
                content: Any = f"error: invalid JSON in tool arguments ({e})"
            else:
                content = (await call_mcp(servers, dispatch, name, arguments)
                           if name in dispatch and isinstance(arguments, dict)
                           else f"error: unknown tool {name!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "name": name,
                             "content": content})


__all__ = ["GatewayChatHarness"]
