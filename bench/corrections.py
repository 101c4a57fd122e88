"""The rollout corrections (`algorithm.rollout_correction`) on a real train-inference mismatch.

The main job's GRPO phase from its SFT checkpoint, with the engine in bfloat16 and the
trainer in float32, so the engine samples with other probabilities than the trainer computes
(the mismatch is bf16 rounding, as between SGLang and an fp32 trainer). One run per mode;
per mode the held-out accuracy of the last version and, averaged over the steps, the K3
estimate of KL(rollout || trainer) and the fraction of loss tokens the mode dropped.

    python -m bench.corrections                   # after `bash scripts/main.sh` (its SFT checkpoint)
    python -m bench.corrections --modes none,icepop --steps 10

Figures: bench/RESULTS.md, "Rollout corrections".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from storage.run_layout import RunLayout

REPO = Path(__file__).resolve().parents[1]


def command(args: argparse.Namespace, mode: str, runs: Path, run_name: str) -> list[str]:
    data = args.data
    sets = [
        f"train.model_path={args.checkpoint}",
        f"data.prompt_data={data / 'train.jsonl'}",
        f"eval.datasets=[{{name: test, path: {data / 'test.jsonl'}, temperature: 0.0}}]",
        "eval.before_train=false",
        f"rollout.num_rollout={args.steps}",
        "engine.dtype=bfloat16", "train.dtype=float32",
        f"algorithm.rollout_correction.mode={mode}",
        f"storage.uri={runs}", f"storage.run_name={run_name}", "logging.progress=false",
    ]
    return [sys.executable, "-m", "flows.cli", "train", "--config",
            str(REPO / "examples/arithmetic/grpo.yaml"), *(x for s in sets for x in ("--set", s))]


def summary(layout: RunLayout, steps: int) -> dict[str, float]:
    per_step = [layout.step_metrics(k) for k in range(steps)]
    evals = layout.evals()

    def mean(key: str) -> float:
        return statistics.fmean(m[key] for m in per_step if key in m)

    return {"accuracy": 100.0 * evals[max(evals)]["eval/test"],
            "k3_kl": mean("mismatch/k3_kl"),
            "masked_frac": mean("mismatch/masked_frac"),
            "ratio_min": min(m["mismatch/ratio_min"] for m in per_step),
            "ratio_max": max(m["mismatch/ratio_max"] for m in per_step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path,
                        default=REPO / "runs/arithmetic-sft/checkpoints/000004")
    parser.add_argument("--data", type=Path, default=REPO / "examples/arithmetic/artifacts/data")
    parser.add_argument("--modes", default="none,token_tis,token_mis,seq_mis,icepop")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="rf-corrections-", dir="/tmp"))
    runs = Path(tempfile.mkdtemp(prefix="rf-corrections-runs-"))
    env = {**os.environ, "ROLLFLOW_HOME": str(home), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false"}
    rows = []
    try:
        for mode in args.modes.split(","):
            name = f"corrections-{mode}-{uuid.uuid4().hex[:6]}"
            done = subprocess.run(command(args, mode, runs, name), cwd=REPO, env=env,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{mode}: rollflow train exited {done.returncode}")
            rows.append((mode, summary(RunLayout.open(str(runs), name), args.steps)))
            print(mode, rows[-1][1], flush=True)
    finally:
        subprocess.run([sys.executable, "-m", "flows.cli", "cluster", "down", "--force"],
                       cwd=REPO, env=env, capture_output=True)
    print("\n| mode | held-out accuracy | K3 KL(rollout‖trainer), mean | tokens dropped | ratio min / max |")
    print("|---|---|---|---|---|")
    for mode, s in rows:
        print(f"| {mode} | {s['accuracy']:.1f}% | {s['k3_kl']:.2e} | {100 * s['masked_frac']:.2f}% "
              f"| {s['ratio_min']:.3f} / {s['ratio_max']:.3f} |")


if __name__ == "__main__":
    main()
