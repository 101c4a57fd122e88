"""A reasoning-gym task by config alone: tiny model -> SFT warm start -> GRPO, each phase a
rollflow train flow run from this folder's YAML, and the held-out score before and after.

The prompts, answers, reward and held-out set all come from the configs' reasoning_gym://
URIs; the only thing made here is the untrained model (no weights can be downloaded), shared
with the arithmetic example. Re-running resumes: committed steps are not redone; `--fresh`
starts over.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from examples.arithmetic.build_model import save_tiny_model
from flows.config.loader import load_config
from flows.servers.prefect_env import prefect_env_defaults

HERE = Path(__file__).resolve().parent
MODEL = HERE.parent / "arithmetic" / "artifacts" / "tiny-llama"


def score(evals: dict[int, dict[str, float]], version: int) -> float:
    """Held-out mean score of the task's scorer, in percent (1.0 a sample = exactly right)."""
    return 100.0 * evals[version]["eval/heldout"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", default="./runs", help="storage root (path or s3://...)")
    parser.add_argument("--fresh", action="store_true", help="delete earlier runs first")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for the GRPO phase, e.g. rollout.num_rollout=10")
    args = parser.parse_args()
    prefect_env_defaults()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    t0 = time.perf_counter()
    model = save_tiny_model(str(MODEL))
    if args.fresh:
        for run in ("reasoning-gym-sft", "reasoning-gym-grpo"):
            shutil.rmtree(os.path.join(args.runs, run), ignore_errors=True)

    from flows.servers.prefect_server import local_prefect_api
    from flows.train import train

    sft = load_config(HERE / "sft.yaml", [f"storage.uri={args.runs}", f"train.model_path={model}"])
    with local_prefect_api():  # one Prefect server for both phases
        t_sft = time.perf_counter()
        sft_result = train(sft)
        t_sft = time.perf_counter() - t_sft
        checkpoint = os.path.join(sft_result["run_dir"], "checkpoints",
                                  f"{sft.rollout.num_rollout - 1:06d}")
        grpo = load_config(HERE / "grpo.yaml", [f"storage.uri={args.runs}",
                                                f"train.model_path={checkpoint}", *args.set])
        t_rl = time.perf_counter()
        rl_result = train(grpo)
        t_rl = time.perf_counter() - t_rl

    untrained, warm = score(sft_result["evals"], 0), score(sft_result["evals"], sft.rollout.num_rollout)
    before, after = score(rl_result["evals"], 0), score(rl_result["evals"], grpo.rollout.num_rollout)
    print("\n=== rollflow reasoning-gym example (basic_arithmetic) ===")
    print(f"SFT run:   {sft_result['run_dir']}  ({t_sft:.1f} s)")
    print(f"GRPO run:  {rl_result['run_dir']}  ({t_rl:.1f} s)")
    print(f"held-out score, untrained -> after SFT: {untrained:.1f}% -> {warm:.1f}%")
    print(f"held-out score before GRPO: {before:.1f}%")
    print(f"held-out score after GRPO:  {after:.1f}%  ({after - before:+.1f} points)")
    print(f"total wall time: {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
