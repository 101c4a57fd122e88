"""A multi-turn tool agent as a custom generate function (`rollout.custom_generate_function_path:
examples.tool_agent.agent:generate`).

```
 prompt ─► engine /generate (stop at "=") ─► model tokens   loss_mask 1, engine log-probs
              ▲                                  │ ends in "<expr>="?
              │                                  ▼
              └──── tool tokens ◄── calculator(expr)     loss_mask 0, log-prob 0.0
```
until the model stops without a call, `max_tool_turns` calls were made, or the sample's
token budget (`sampling_params["max_new_tokens"]`, tool tokens included) runs out. An abort
returns the sample as it stands (status aborted); called again (partial rollout) it goes on
from `sample.tokens` with the budget the loop hands it. The engine URL comes from
`engines.hooks.protocols.engine_url(args, sample)`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Protocol

from engines.hooks.protocols import engine_url
from engines.rollout.sglang_client import GenerateOutput, SGLangClient
from examples.tool_agent.calculator import TRIGGER, observe
from storage.sample import Sample, Status

MAX_TOOL_TURNS = 4
_SEED_STRIDE = 1_000_003  # each turn samples with its own seed
_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool the model calls by ending a turn with one of `stops`; `respond` maps that
    turn's text to the tool's output (None: the turn was no call after all)."""

    stops: tuple[str, ...]
    respond: Callable[[str], str | None]


CALCULATOR = Tool(stops=(TRIGGER,), respond=observe)


class Engine(Protocol):
    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateOutput: ...


@lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def append_tool_output(sample: Sample, token_ids: list[int], text: str) -> None:
    """Environment tokens: in the context, not in the loss; log-prob 0.0 keeps alignment."""
    sample.tokens.extend(token_ids)
    sample.response += text
    sample.response_length += len(token_ids)
    sample.loss_mask.extend([0] * len(token_ids))
    sample.rollout_log_probs.extend([0.0] * len(token_ids))


def _turn_params(
    sampling_params: dict[str, Any], budget: int, turn: int, tool: Tool
) -> dict[str, Any]:
    params = {
        **sampling_params,
        "max_new_tokens": budget,
        "stop": [*sampling_params.get("stop", []), *tool.stops],
        "no_stop_trim": True,
    }
    if "sampling_seed" in params:
        params["sampling_seed"] = int(params["sampling_seed"]) + _SEED_STRIDE * turn
    return params


async def run_agent(
    engine: Engine,
    tokenizer: Any,
    sample: Sample,
    sampling_params: dict[str, Any],
    max_tool_turns: int = MAX_TOOL_TURNS,
    tool: Tool = CALCULATOR,
) -> Sample:
    budget = int(sampling_params["max_new_tokens"])
    calls = int(sample.metadata.get("tool_calls", 0))
    turn = int(sample.metadata.get("turns", 0))
    sample.status = Status.TRUNCATED  # unless a turn ends otherwise before the budget does
    while budget > 0:
        out = await engine.generate(
            sample.tokens,
            _turn_params(sampling_params, budget, turn, tool),
            rid=f"sample-{sample.index}-turn-{turn}",
        )
        text = tokenizer.decode(out.output_ids, skip_special_tokens=True)
        sample.append_response(list(out.output_ids), list(out.log_probs), text)
        sample.weight_version = out.weight_version
        budget -= len(out.output_ids)
        turn += 1
        sample.status = _FINISH.get(out.finish_reason.get("type", ""), Status.FAILED)
        if sample.status != Status.COMPLETED:
            break
        called = out.finish_reason.get("matched") in tool.stops
        observation = tool.respond(text) if called else None
        if observation is None or calls >= max_tool_turns:
            break
        tool_ids = tokenizer.encode(observation, add_special_tokens=False)[:budget]
        append_tool_output(sample, tool_ids, tokenizer.decode(tool_ids))
        budget -= len(tool_ids)
        calls += 1
        sample.status = Status.TRUNCATED  # the budget may run out before the model answers
    sample.metadata["tool_calls"] = calls
    sample.metadata["turns"] = turn
    sample.check()
    return sample


def tokenizer_path(args: Any) -> str:
    path = args.engine.model_path or args.train.model_path or args.train.load
    if not path:
        raise ValueError("examples.tool_agent: set engine.model_path (the tokenizer to use)")
    return str(path)


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """The custom generate function (a `GenerateFn`)."""
    tokenizer = getattr(args, "tokenizer", None) or _tokenizer(tokenizer_path(args))
    max_turns = int(sample.metadata.get("max_tool_turns", MAX_TOOL_TURNS))
    async with SGLangClient(engine_url(args, sample)) as client:
        return await run_agent(client, tokenizer, sample, sampling_params, max_turns)
