"""The calculator agent: per-token bookkeeping against a scripted engine (aborts, budgets), and
against a real embedded engine on the tiny model, where the model tokens' rollout log-probs
must equal a teacher-forced forward of the final token sequence (so nothing is shifted)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.hooks.loader import check_protocol
from engines.hooks.protocols import EngineUrlError, GenerateFn
from engines.hooks.protocols import engine_url as resolve_engine_url
from engines.inference.engine_actor import EngineActor
from engines.rollout.generation import HookArgs
from engines.rollout.sglang_client import GenerateOutput, SGLangClient
from examples.tool_agent import agent
from examples.tool_agent.calculator import evaluate, find_call, observe
from flows.config.run import EngineConfig, RollflowConfig
from storage.sample import Sample, Status


def test_calculator_parses_only_arithmetic() -> None:
    assert find_call("so 12*3=") == "12*3" and find_call("12*3") is None
    assert evaluate("12*3") == "36" and evaluate("1/4") == "0.25" and evaluate("-2-3") == "-5"
    assert observe("x 7+8=") == "15\n" and observe("1/0=") == "error\n"
    assert observe("__import__('os')=") == "error\n"  # never evaluated as Python
    assert observe("9*9*9*9*9*9*9*9*9*9*9*9*9*9=") == "error\n"  # too large


def test_engine_url_comes_from_the_loops_hook_args() -> None:
    """The generation loop hands hooks a `HookArgs`: its `engine_url` is where they send."""
    cfg = RollflowConfig.model_validate({
        "data": {"prompt_data": "unused.jsonl"},
        "rollout": {"num_rollout": 1, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
        "engine": {"backend": "sglang", "urls": ["http://external:1"]},
        "train": {"backend": "mock", "weight_sync": "distributed"},
    })
    s = Sample(index=0, group_index=0, prompt="p")
    assert resolve_engine_url(HookArgs(cfg, "http://router:2"), s) == "http://router:2"
    assert resolve_engine_url(cfg, s) == "http://external:1"  # the bare config: engine.urls
    s.metadata["engine_url"] = "http://pinned:3"  # sticky routing wins
    assert resolve_engine_url(HookArgs(cfg, "http://router:2"), s) == "http://pinned:3"
    bare = cfg.model_copy(update={"engine": EngineConfig(backend="embedded")})
    with pytest.raises(EngineUrlError, match="args.engine_url"):
        resolve_engine_url(HookArgs(bare), Sample(index=1, group_index=0, prompt="p"))


class ScriptedEngine:
    """The external edge faked: answers each /generate with the next scripted turn."""

    def __init__(self, tokenizer: Any, turns: list[tuple[str, dict[str, Any]]]):
        self.tokenizer, self.turns, self.requests = tokenizer, list(turns), []

    async def generate(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str | None = None
    ) -> GenerateOutput:
        self.requests.append((list(input_ids), dict(sampling_params)))
        text, finish = self.turns.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[: sampling_params["max_new_tokens"]]
        lps = [-0.5 - i for i in range(len(ids))]
        return GenerateOutput(ids, text, lps, finish, weight_version=3)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def new_sample(tokenizer: Any, prompt: str = "what is 2+3? ", index: int = 5) -> Sample:
    return Sample(index=index, group_index=0, prompt=prompt, tokens=tokenizer.encode(prompt, add_special_tokens=False))


def test_scripted_turns_mask_tool_tokens_and_resume_after_abort(tokenizer: Any) -> None:
    stop = {"type": "stop", "matched": "="}
    engine = ScriptedEngine(tokenizer, [("2+3=", stop), ("ok so", {"type": "abort"})])
    s = new_sample(tokenizer)
    n_prompt = len(s.tokens)
    params = {"max_new_tokens": 20, "temperature": 1.0, "sampling_seed": 100}
    asyncio.run(agent.run_agent(engine, tokenizer, s, params))
    # "2+3=" (4 model) + "5\n" (2 tool) + "ok so" (5 model), then aborted
    assert s.status == Status.ABORTED and s.response == "2+3=5\nok so"
    assert s.loss_mask == [1] * 4 + [0] * 2 + [1] * 5
    assert s.rollout_log_probs == [-0.5, -1.5, -2.5, -3.5, 0.0, 0.0, -0.5, -1.5, -2.5, -3.5, -4.5]
    assert s.prompt_length == n_prompt and s.weight_version == 3
    first, second = engine.requests
    assert first[1]["stop"] == ["="] and first[1]["no_stop_trim"] is True
    assert second[0] == s.tokens[: n_prompt + 6] and second[1]["max_new_tokens"] == 14
    assert second[1]["sampling_seed"] != first[1]["sampling_seed"]

    # Partial rollout: the loop calls again with what is left; the agent continues the tokens.
    engine.turns = [(" 5", {"type": "stop", "matched": 2})]
    asyncio.run(agent.run_agent(engine, tokenizer, s, {**params, "max_new_tokens": 9}))
    assert engine.requests[-1][0] == s.tokens[:-2] and s.status == Status.COMPLETED
    assert s.loss_mask[-2:] == [1, 1] and s.metadata == {"tool_calls": 1, "turns": 3}


def test_tool_output_is_cut_at_the_budget(tokenizer: Any) -> None:
    engine = ScriptedEngine(tokenizer, [("12*3=", {"type": "stop", "matched": "="})])
    s = new_sample(tokenizer)
    asyncio.run(agent.run_agent(engine, tokenizer, s, {"max_new_tokens": 6}))
    assert s.response_length == 6 and s.loss_mask == [1] * 5 + [0]
    assert s.status == Status.TRUNCATED and s.response.endswith("=3")


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: str) -> Iterator[str]:
    threads = torch.get_num_threads()
    actor = EngineActor(EngineConfig(backend="embedded", model_path=tiny_model_dir), 0, num_threads=1)
    yield actor.url()
    actor.shutdown()
    torch.set_num_threads(threads)


def test_agent_against_real_engine_keeps_log_probs_aligned(
    tiny_model_dir: str, engine_url: str, tokenizer: Any
) -> None:
    check_protocol(agent.generate, GenerateFn, "rollout.custom_generate_function_path")
    args = RollflowConfig.model_validate(
        {
            "data": {"prompt_data": "unused.jsonl"},
            "rollout": {"num_rollout": 1, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
            "engine": {"backend": "sglang", "urls": [engine_url], "model_path": tiny_model_dir},
            "train": {"backend": "mock", "weight_sync": "distributed"},
        }
    )
    # The untrained tiny model rarely writes "<expr>=", so the real-engine run uses a tool
    # that any digit calls (the tool is the external edge; the agent's bookkeeping is real).
    # The calculator itself goes through the same path once, via agent.generate.
    digit_tool = agent.Tool(stops=tuple("0123456789"), respond=lambda text: "ok\n")
    samples = [new_sample(tokenizer, "1+2=3\n4*5=20\n7+8=", index=i) for i in range(8)]
    params = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 1.0, "top_k": -1}

    async def main() -> list[Sample]:
        async with SGLangClient(engine_url) as client:
            runs = [
                agent.run_agent(client, tokenizer, s, {**params, "sampling_seed": 7 + s.index}, tool=digit_tool)
                for s in samples[1:]
            ]
            calc = agent.generate(args, samples[0], {**params, "sampling_seed": 7})
            return list(await asyncio.gather(calc, *runs))

    done = asyncio.run(main())
    assert sum(s.metadata["tool_calls"] for s in done[1:]) >= 4
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for s in done:
        s.check()
        assert s.status in (Status.COMPLETED, Status.TRUNCATED)
        assert s.response_length <= 24 and len(s.rollout_log_probs) == s.response_length
        tool = [i for i, m in enumerate(s.loss_mask) if m == 0]
        assert all(s.rollout_log_probs[i] == 0.0 for i in tool)
        assert len(tool) <= 3 * s.metadata["tool_calls"]  # "ok\n" (or a short value) per call
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0].float()
        logp = torch.log_softmax(logits[:-1], dim=-1)
        targets = torch.tensor(s.tokens[1:])
        forward = logp[torch.arange(len(targets)), targets][s.prompt_length - 1 :]
        model_pos = [i for i, m in enumerate(s.loss_mask) if m == 1]
        assert torch.allclose(
            forward[model_pos], torch.tensor([s.rollout_log_probs[i] for i in model_pos]), atol=1e-4
        )
        # every tool segment is the calculator's answer to the model text just before it
        text, i = "", 0
        while i < s.response_length:
            j = i
            while j < s.response_length and s.loss_mask[j] == s.loss_mask[i]:
                j += 1
            chunk = tokenizer.decode(s.response_tokens[i:j])
            if s.loss_mask[i] == 0:
                full = observe(text) if s is done[0] else "ok\n"
                assert full is not None and full.startswith(chunk)
            text = chunk
            i = j
