"""The agent example end to end: a tiny model, a warm start on a few worked sums, then GRPO of
the `openai`-client agent through the train flow.

The untrained tiny model never writes a valid tool call, so it is first taught by heart how
three sums go (call the calculator, read its result, answer: `model.teach`); GRPO then trains
the agent on every one-digit sum, the three included, rewarded by the agent itself. It prints
each step's mean reward and agent turns. Re-running it resumes the GRPO run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from examples.openai_agent.agent import CALCULATOR
from examples.openai_agent.model import Lesson, save_agent_model, teach
from flows.config.loader import load_config
from flows.servers.prefect_env import prefect_env_defaults

HERE = Path(__file__).resolve().parent
WORKED = [(2, 3), (4, 1), (3, 3)]


def lessons() -> list[Lesson]:
    out: list[Lesson] = []
    for a, b in WORKED:
        ask = [{"role": "user", "content": f"what is {a}+{b}?"}]
        args = json.dumps({"expression": f"{a}+{b}"})
        call = f'<tool_call>{{"name": "calculator", "arguments": {args}}}</tool_call>'
        answered = [*ask, {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "calculator", "arguments": args}}]},
            {"role": "tool", "content": str(a + b)}]
        out += [(ask, call), (answered, f"the answer is {a + b}")]
    return out


def prepare(artifacts: str) -> tuple[str, str]:
    """(questions file, warm-started model), made once."""
    os.makedirs(artifacts, exist_ok=True)
    questions = os.path.join(artifacts, "sums.jsonl")
    with open(questions, "w") as f:
        for a in range(1, 10):
            for b in range(1, 10):
                f.write(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n")
    taught = os.path.join(artifacts, "tiny-agent-warm")
    if not os.path.exists(os.path.join(taught, "config.json")):
        random = save_agent_model(os.path.join(artifacts, "tiny-agent"))
        teach(random, taught, lessons(), [CALCULATOR])
    return questions, taught


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default="./runs")
    parser.add_argument("--artifacts", default=str(HERE / "artifacts"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    prefect_env_defaults()
    t0 = time.perf_counter()
    questions, model = prepare(args.artifacts)
    config = load_config(HERE / "grpo.yaml", [
        f"storage.uri={args.runs}", f"data.prompt_data={questions}",
        f"train.model_path={model}", f"engine.model_path={model}", *args.set])

    from flows.servers.prefect_server import local_prefect_api
    from flows.train import train
    from storage.run_layout import RunLayout

    with local_prefect_api():
        result: dict[str, Any] = train(config)
    layout = RunLayout.open(config.storage.uri, config.storage.run_name)
    print("\n=== rollflow openai-agent example ===")
    print("step  reward  agent turns")
    for k in layout.committed_steps():
        m = layout.step_metrics(k)
        print(f"{k:4d}  {m['reward/mean']:.3f}  {m.get('rollout/agent_turns_mean', 0.0):.2f}")
    print(f"run: {result['run_dir']}  ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
