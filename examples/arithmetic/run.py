"""The main job: data + tiny model -> SFT warm start -> GRPO, each phase a rollflow train flow.

Re-running it resumes: committed steps of either phase are not redone. `--fresh` starts over.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

from examples.arithmetic.build_model import save_tiny_model
from examples.arithmetic.make_data import write_datasets
from flows.config.loader import load_config
from flows.config.run import RollflowConfig
from flows.servers.prefect_env import prefect_env_defaults

HERE = Path(__file__).resolve().parent


def phase_config(name: str, runs_root: str, data: dict[str, str], extra: list[str]) -> RollflowConfig:
    overrides = [
        f"storage.uri={runs_root}",
        f"eval.datasets=[{{name: test, path: {data['test']}, temperature: 0.0}}]",
        *extra,
    ]
    return load_config(HERE / f"{name}.yaml", overrides)


def prepare_artifacts(artifacts: str) -> tuple[dict[str, str], str]:
    """The example's datasets and its untrained tiny model (both made once, then reused)."""
    data = write_datasets(os.path.join(artifacts, "data"), n_train=4000, n_test=500, n_sft=1000)
    return data, save_tiny_model(os.path.join(artifacts, "tiny-llama"))


def sft_config(runs_root: str, data: dict[str, str], model: str) -> RollflowConfig:
    """The SFT phase's config: sft.yaml from the untrained model."""
    return phase_config("sft", runs_root, data, [
        f"data.prompt_data={data['sft']}", f"train.model_path={model}",
    ])


def run_sft(sft: RollflowConfig) -> tuple[dict[str, Any], str]:
    """The SFT warm start (resumed, not redone, when committed): (train result, checkpoint)."""
    from flows.train import train

    result = train(sft)
    last = sft.rollout.num_rollout - 1
    return result, os.path.join(result["run_dir"], "checkpoints", f"{last:06d}")


def grpo_config(
    runs_root: str, data: dict[str, str], sft_ckpt: str, extra: list[str]
) -> RollflowConfig:
    """The GRPO phase's config: grpo.yaml from the SFT checkpoint, then `extra` overrides."""
    return phase_config("grpo", runs_root, data, [
        f"data.prompt_data={data['train']}", f"train.model_path={sft_ckpt}", *extra,
    ])


def accuracy(evals: dict[int, dict[str, float]], version: int) -> float:
    return 100.0 * evals[version]["eval/test"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default="./runs", help="storage root (path or s3://...)")
    parser.add_argument("--artifacts", default=str(HERE / "artifacts"))
    parser.add_argument("--fresh", action="store_true", help="delete earlier runs first")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for the GRPO phase, e.g. rollout.num_rollout=10")
    args = parser.parse_args()
    prefect_env_defaults()  # the CLI's: UI logs, a quiet console, 90 s for Prefect to start
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    t0 = time.perf_counter()
    data, model = prepare_artifacts(args.artifacts)
    if args.fresh:
        for run in ("arithmetic-sft", "arithmetic-grpo"):
            shutil.rmtree(os.path.join(args.runs, run), ignore_errors=True)

    from engines.cluster.head import head_starting
    from flows.servers.prefect_server import local_prefect_api
    from flows.train import train

    # one Prefect server for both phases (flows/servers/prefect_server.py), started beside
    # the Ray head when none is running
    sft = sft_config(args.runs, data, model)
    with head_starting(sft.cluster), local_prefect_api():
        t_sft = time.perf_counter()
        sft_result, sft_ckpt = run_sft(sft)
        t_sft = time.perf_counter() - t_sft

        grpo = grpo_config(args.runs, data, sft_ckpt, args.set)
        t_rl = time.perf_counter()
        rl_result = train(grpo)
        t_rl = time.perf_counter() - t_rl

    evals = rl_result["evals"]
    before, after = accuracy(evals, 0), accuracy(evals, grpo.rollout.num_rollout)
    print("\n=== rollflow arithmetic example ===")
    print(f"SFT run:   {sft_result['run_dir']}  ({t_sft:.1f} s)")
    print(f"GRPO run:  {rl_result['run_dir']}  ({t_rl:.1f} s)")
    print(f"held-out exact match before RL: {before:.1f}%")
    print(f"held-out exact match after RL:  {after:.1f}%  ({after - before:+.1f} points)")
    print(f"reward curve: {rl_result.get('plot')}")
    print(f"total wall time: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
