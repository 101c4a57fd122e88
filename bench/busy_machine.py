"""A 3-step GRPO run from the main job's SFT checkpoint, on an idle machine and beside CPU
burners (`python -c "while True: pass"` at normal priority): what a user sees when anything
else runs on the machine. Each run is `rollflow train` from the shell, with its own
ROLLFLOW_HOME, so it starts (and then stops) a head of its own: start-up is in the time.

    python -m bench.busy_machine                    # after `bash scripts/main.sh` (its SFT checkpoint)
    python -m bench.busy_machine --repo /tmp/old    # another checkout, same checkpoint and data

Figures: bench/RESULTS.md, "Busy machine".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BURNER = "while True: pass"


def grpo_command(repo: Path, checkpoint: Path, data: Path, steps: int) -> list[str]:
    return [
        sys.executable, "-m", "flows.cli", "train",
        "--config", str(repo / "examples/arithmetic/grpo.yaml"),
        "--set", f"train.model_path={checkpoint}",
        "--set", f"data.prompt_data={data / 'train.jsonl'}",
        "--set", f"eval.datasets=[{{name: test, path: {data / 'test.jsonl'}, temperature: 0.0}}]",
        "--set", "eval.before_train=false",
        "--set", f"rollout.num_rollout={steps}",
        "--set", f"storage.run_name=busy-{uuid.uuid4().hex[:6]}",
    ]


def timed_run(repo: Path, command: list[str], burners: int, timeout: float) -> tuple[float, bool]:
    """(seconds, finished) of `command` in `repo` beside `burners` busy loops."""
    home = Path(tempfile.mkdtemp(prefix="rf-busy-", dir="/tmp"))
    runs = Path(tempfile.mkdtemp(prefix="rf-busy-runs-"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    env.update(ROLLFLOW_HOME=str(home), PYTHONPATH=str(repo), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    spinning = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in range(burners)]
    start = time.perf_counter()
    try:
        done = subprocess.run([*command, "--set", f"storage.uri={runs}"], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=timeout)
        finished = done.returncode == 0
        if not finished:
            print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
    except subprocess.TimeoutExpired:
        finished = False
    seconds = time.perf_counter() - start
    for proc in spinning:
        proc.kill()
        proc.wait()
    subprocess.run([sys.executable, "-m", "flows.cli", "cluster", "down", "--force"], cwd=repo, env=env,
                   capture_output=True, timeout=120)
    return seconds, finished


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=REPO, help="the rollflow checkout to run")
    parser.add_argument("--checkpoint", type=Path, default=REPO / "runs/arithmetic-sft/checkpoints/000004")
    parser.add_argument("--data", type=Path, default=REPO / "examples/arithmetic/artifacts/data")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    if not args.checkpoint.exists():
        sys.exit(f"{args.checkpoint}: no SFT checkpoint; run `bash scripts/main.sh` first")
    command = grpo_command(args.repo.resolve(), args.checkpoint.resolve(), args.data.resolve(), args.steps)
    idle, idle_ok = timed_run(args.repo, command, 0, args.timeout)
    busy, busy_ok = timed_run(args.repo, command, args.burners, args.timeout)
    print(f"repo {args.repo} ({args.steps} GRPO steps, start-up included)")
    print(f"idle: {idle:.1f} s{'' if idle_ok else ' (did not finish)'}")
    print(f"{args.burners} burners: {busy:.1f} s{'' if busy_ok else ' (did not finish)'}"
          + (f", {busy / idle:.2f}x idle" if idle_ok and busy_ok else ""))


if __name__ == "__main__":
    main()
