"""The calculator agent (`examples.tool_agent.agent:generate`) as the custom generate function
of a real run: embedded engine, torch trainer, real Ray and Prefect, two steps.

An untrained tiny model writes the calculator's call (`<digit>=`) too rarely to test with, so
the run uses a test copy of the tiny model rewired into a bigram model that *always* does: its
layers add nothing to the residual stream (o_proj and down_proj zero), so the logits depend
only on the last token; after a digit it writes `=` (the call), after anything else a digit.
Every turn is then `d=`, the calculator answers `d\n`, and a sample ends after MAX_TOOL_TURNS
calls and one last turn. The agent, the tool, the loop and the trainer stay real.
"""

from __future__ import annotations

import json
import math
import uuid

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples.tool_agent.agent import MAX_TOOL_TURNS
from examples.tool_agent.calculator import observe
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from storage.sample import Sample, Status
from tests.support.bigram_model import save_bigram_model
from tests.support.configs import arithmetic_config


@pytest.fixture(scope="module")
def calculator_model(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    digits = list("0123456789")  # after a digit `=`, after anything else a digit
    return save_bigram_model(tiny_model_dir, str(tmp_path_factory.mktemp("model") / "calculator-bigram"),
                             marked=digits, after_unmarked=digits, after_marked=["="])


@pytest.fixture(scope="module")
def questions(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One-digit sums: `last_number` rewards a final `d=` that names the label, about one
    sample in ten, so groups have reward variance and the policy gradient is not zero."""
    path = tmp_path_factory.mktemp("data") / "questions.jsonl"
    rows = [{"prompt": f"what is {a}+{b}? ", "label": str(a + b)} for a in range(1, 5) for b in range(1, 5)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def segments(s: Sample) -> list[tuple[int, list[int]]]:
    """The response as runs of equal loss-mask value: (mask, token ids)."""
    runs: list[tuple[int, list[int]]] = []
    for tok, m in zip(s.response_tokens, s.loss_mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(tok)
        else:
            runs.append((m, [tok]))
    return runs


def test_tool_agent_runs_and_trains_through_the_flow(
    prefect_api, ray_address, calculator_model, questions, tmp_path
):
    from flows.train import train

    cfg = arithmetic_config(
        run_name=f"tool-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
        data={"train": questions}, model_dir=calculator_model, ray_address=ray_address,
        backend="embedded",
        overrides=[
            "rollout.custom_generate_function_path=examples.tool_agent.agent:generate",
            "rollout.rm_type=last_number", "rollout.max_response_len=24",
            "rollout.rollout_batch_size=2",
        ],
    )
    tokenizer = AutoTokenizer.from_pretrained(calculator_model)
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0, 1]
    for k in (0, 1):
        samples = read_samples(layout.store, f"steps/{k:06d}", "train.arrow")
        assert len(samples) == 2 * cfg.rollout.n_samples_per_prompt
        for s in samples:
            assert s.status == Status.COMPLETED and s.metadata["tool_calls"] == MAX_TOOL_TURNS
            assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
            assert s.weight_version == k  # step 1 ran on the weights trained at step 0
            runs = segments(s)
            assert [m for m, _ in runs] == [1, 0] * MAX_TOOL_TURNS + [1]
            text = ""
            for m, ids in runs:
                chunk = tokenizer.decode(ids)
                if m == 0:  # the calculator's answer to the turn just before it
                    assert chunk == observe(text)
                text = chunk
            tool = [i for i, m in enumerate(s.loss_mask) if m == 0]
            assert len(tool) == 2 * MAX_TOOL_TURNS
            assert all(s.rollout_log_probs[i] == 0.0 for i in tool)
            # The engine's log-probs sit on the model's own tokens: a digit is one of ten
            # equally likely ones, the `=` after it is certain.
            for i, m in enumerate(s.loss_mask):
                if m == 1:
                    want = 0.0 if tokenizer.decode(s.response_tokens[i]) == "=" else -math.log(10)
                    assert s.rollout_log_probs[i] == pytest.approx(want, abs=1e-2)
            assert s.reward in (0.0, 1.0)
        record = layout.task_record(k, "train")
        assert record is not None and record["seconds"] > 0
        metrics = layout.step_metrics(k)
        assert metrics["train/num_samples"] == len(samples) and metrics["train/skipped"] == 0.0
        assert metrics["train/weight_version"] == k + 1  # the policy took a step


def test_calculator_model_writes_calls(calculator_model: str) -> None:
    """The premise of the flow test, checked directly: `d=` after any prompt."""
    tokenizer = AutoTokenizer.from_pretrained(calculator_model)
    model = AutoModelForCausalLM.from_pretrained(calculator_model).eval()
    ids = tokenizer.encode("what is 2+3? ", add_special_tokens=False)
    with torch.no_grad():
        first = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
        second = model(torch.tensor([[*ids, tokenizer.convert_tokens_to_ids("7")]])).logits[0, -1].softmax(-1)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    assert float(first[digits].sum()) > 1 - 1e-6
    assert float(second[tokenizer.convert_tokens_to_ids("=")]) > 1 - 1e-6
