"""The code example: small generated Python functions with tests, by config alone.

Data + tiny model -> SFT warm start -> GRPO, each phase a rollflow train flow run from this
folder's YAML; every held-out answer runs in the sandbox (`rollout.rm_type: code_tests`)
and the pass rate is printed before and after GRPO: the mean share of tests passed, and the
share of functions with every test passing. The tiny model is the arithmetic example's.
Re-running resumes: committed steps of either phase are not redone; `--fresh` starts over.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

from examples.arithmetic.build_model import save_tiny_model
from examples.code_tests.make_data import write_datasets
from flows.config.loader import load_config
from flows.config.run import RollflowConfig
from flows.servers.prefect_env import prefect_env_defaults

HERE = Path(__file__).resolve().parent
MODEL = HERE.parent / "arithmetic" / "artifacts" / "tiny-llama"
RUNS = ("code-tests-sft", "code-tests-grpo")


def phase_config(name: str, runs_root: str, data: dict[str, str], extra: list[str]) -> RollflowConfig:
    """`name`.yaml with the data paths made, the held-out set twice (share of tests passed,
    every test passed) and `extra` overrides last."""
    test = f"path: {data['test']}, label_key: label, temperature: 0.0"
    return load_config(HERE / f"{name}.yaml", [
        f"storage.uri={runs_root}",
        f"eval.datasets=[{{name: test, {test}}}, {{name: test_all_pass, {test}, "
        f"custom_rm_path: 'examples.code_tests.all_pass:all_pass'}}]",
        *extra,
    ])


def pass_rates(evals: dict[int, dict[str, float]], version: int) -> tuple[float, float]:
    """(mean share of tests passed, share of functions passing all), in percent."""
    return 100.0 * evals[version]["eval/test"], 100.0 * evals[version]["eval/test_all_pass"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default="./runs", help="storage root (path or s3://...)")
    parser.add_argument("--artifacts", default=str(HERE / "artifacts"),
                        help="where the datasets are made (default: this example's folder)")
    parser.add_argument("--fresh", action="store_true", help="delete earlier runs first")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for the GRPO phase, e.g. rollout.num_rollout=20")
    args = parser.parse_args()
    prefect_env_defaults()  # the CLI's: UI logs, a quiet console, 90 s for Prefect to start
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    t0 = time.perf_counter()
    data = write_datasets(os.path.join(args.artifacts, "data"))
    model = save_tiny_model(str(MODEL))
    if args.fresh:
        for run in RUNS:
            shutil.rmtree(os.path.join(args.runs, run), ignore_errors=True)

    from flows.servers.prefect_server import local_prefect_api
    from flows.train import train

    sft = phase_config("sft", args.runs, data, [f"data.prompt_data={data['sft']}",
                                                f"train.model_path={model}"])
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    with local_prefect_api():  # one Prefect server for both phases
        started = time.perf_counter()
        results["sft"] = train(sft)
        seconds["sft"] = time.perf_counter() - started
        checkpoint = os.path.join(results["sft"]["run_dir"], "checkpoints",
                                  f"{sft.rollout.num_rollout - 1:06d}")
        grpo = phase_config("grpo", args.runs, data, [
            f"data.prompt_data={data['train']}", f"train.model_path={checkpoint}", *args.set])
        started = time.perf_counter()
        results["grpo"] = train(grpo)
        seconds["grpo"] = time.perf_counter() - started

    untrained = pass_rates(results["sft"]["evals"], 0)
    before = pass_rates(results["grpo"]["evals"], 0)
    after = pass_rates(results["grpo"]["evals"], grpo.rollout.num_rollout)
    print("\n=== rollflow code tests example (generated functions, sandboxed tests) ===")
    print(f"SFT run:   {results['sft']['run_dir']}  ({seconds['sft']:.1f} s)")
    print(f"GRPO run:  {results['grpo']['run_dir']}  ({seconds['grpo']:.1f} s)")
    print("held-out pass rate, tests passed / functions passing all:")
    print(f"  untrained:   {untrained[0]:5.1f}% / {untrained[1]:5.1f}%")
    print(f"  before GRPO: {before[0]:5.1f}% / {before[1]:5.1f}%")
    print(f"  after GRPO:  {after[0]:5.1f}% / {after[1]:5.1f}%  "
          f"({after[0] - before[0]:+.1f} / {after[1] - before[1]:+.1f} points)")
    print(f"reward curve: {results['grpo'].get('plot')}")
    print(f"total wall time: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
