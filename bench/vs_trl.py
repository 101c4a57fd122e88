"""rollflow vs TRL on the main job: time to held-out accuracy, side by side, one invocation.

    pip install -e .[bench]            # TRL, only for this benchmark
    python -m bench.vs_trl             # minutes on a CPU (bench/RESULTS.md, "vs TRL"); --help

Both sides start from the same checkpoint, rollflow's own SFT warm start of the arithmetic
main job (`examples/arithmetic/run.py`: made once under `--runs`, then reused), train on the
same RL prompts and are scored on the same 500 held-out problems (greedy, exact match) by
one evaluator (`trl_baseline.greedy_accuracy`), on the same machine, back to back:

* TRL: `GRPOTrainer`, 64 completions (8 prompts x 8) per optimizer step, fp32, no gradient
  checkpointing (its GPU defaults are far slower on a CPU); weights copied every
  `--snapshot-every` samples (the copy is off the clock).
* rollflow: the GRPO phase of `scripts/main.sh` (examples/arithmetic/grpo.yaml, `--set` to
  override), a fresh run of the `train` flow with a checkpoint every `--snapshot-every`
  samples instead of in-flow evaluation; each step's end is its `COMMITTED` marker.

Threads: every torch process of either side gets `--threads` (TRL's trainer; rollflow's
engine and trainer actors through `cluster.actor_num_threads`), by default torch's default.

Clocks: seconds of training, from the first step (rollflow: the first step's start less the
typical gap between steps, i.e. its flow-run start-up; TRL: `on_train_begin`), less the time
either side spends saving the snapshots (rollflow: the commit of a step that checkpoints,
`time/commit`; TRL: the weight copy; their CPU stays counted); start-up
(actors, model loading / trainer construction) is reported apart. CPU: seconds of every
process doing the work (TRL: this process; rollflow: this process and its children, e.g.
the Prefect server, plus the run's Ray actors, not Ray's own daemons). Evaluation happens
after both runs, on the snapshots, so it costs neither side time.

Both train on `--samples` generated samples (default 38,400: TRL's 600 steps of 64).
Prints the curves (accuracy at each sample count, with seconds and CPU seconds), a
time-to-accuracy table and the ratio rollflow time / TRL time to reach TRL's final accuracy,
and to reach its settled accuracy (the mean of its last three snapshots: one snapshot moves
by 1-2 points from the next); writes `curves.png` and `results.json` under `{runs}/vs_trl/`.
A local Ray head this benchmark starts is stopped at its end; one that was up stays up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.cpu_meter import CpuMeter
from bench.local_head import stopping_a_new_head
from bench.trl_baseline import TrlRun, evaluate_states, read_rows, run_trl
from engines.cluster.head import connect
from examples.arithmetic.run import grpo_config, prepare_artifacts, run_sft, sft_config
from flows.servers.prefect_env import prefect_env_defaults
from flows.servers.prefect_server import local_prefect_api

RUN_NAME = "vs-trl-rollflow"


@dataclass(frozen=True, slots=True)
class Point:
    samples: int
    seconds: float
    cpu: float
    accuracy: float = float("nan")


@dataclass(frozen=True, slots=True)
class Curve:
    name: str
    points: list[Point]  # the start (SFT, 0 s) first
    startup: float
    seconds: float
    cpu: float
    cpu_by_process: dict[str, float] | None = None


def trl_curve(run: TrlRun, accuracies: list[float], startup: float) -> Curve:
    """`accuracies[0]` is the SFT checkpoint's, the rest the snapshots' in order."""
    points = [Point(0, 0.0, 0.0, accuracies[0])]
    points += [Point(s.samples, s.seconds, s.cpu, a)
               for s, a in zip(run.snapshots, accuracies[1:], strict=True)]
    return Curve(f"TRL lr={run.lr:g}", points, startup, run.seconds, run.cpu)



def actor_title_prefix(cfg: Any) -> str:
    """How the run's Ray actors title their processes while they start (`ray::` and their
    name, `{run key}:{role}@...`): the CPU meter follows processes by it. With the name
    alone (before actor names carried the run directory) it followed none of them, and
    reported the driver's and Prefect's CPU as the run's."""
    from engines.cluster.registry import cfg_run_key

    return f"ray::{cfg_run_key(cfg)}:"

def rollflow_run(
    runs: str, data: dict[str, str], sft_ckpt: str, snapshot_every: int,
    threads: int, extra: list[str], samples: int | None = None,
) -> tuple[Curve, list[str]]:
    """A fresh GRPO run of the main job's config, for at least `samples` samples unless
    `extra` sets rollout.num_rollout; (curve without accuracies, checkpoints)."""
    from engines.cluster.actors import kill_run_actors
    from flows.train import train

    base = grpo_config(runs, data, sft_ckpt, extra)
    per_step = base.rollout.rollout_batch_size * base.rollout.n_samples_per_prompt
    if snapshot_every % per_step:
        raise SystemExit(f"--snapshot-every {snapshot_every}: not a multiple of rollflow's "
                         f"{per_step} samples per rollout step")
    sets = [f"storage.run_name={RUN_NAME}", "eval.datasets=[]",
            f"train.save_interval={snapshot_every // per_step}"]
    if samples is not None:
        sets.append(f"rollout.num_rollout={-(-samples // per_step)}")
    sets += extra
    sets.append(f"cluster.actor_num_threads={threads}")
    cfg = grpo_config(runs, data, sft_ckpt, sets)
    run_dir = Path(runs) / RUN_NAME
    shutil.rmtree(run_dir, ignore_errors=True)
    connect(cfg.cluster)
    kill_run_actors(cfg)  # left by an interrupted earlier bench: start as fresh as TRL does
    called = time.time()
    with CpuMeter(prefix=actor_title_prefix(cfg)) as meter:
        train(cfg)
    steps = sorted((run_dir / "steps").glob("[0-9]*"))
    committed = [(s / "COMMITTED").stat().st_mtime for s in steps]
    started = [json.loads((s / "tasks" / "sample_prompts.json").read_text())["started_at"]
               for s in steps]
    gaps = sorted(b - a for a, b in zip(committed, started[1:], strict=False))
    t0 = started[0] - (gaps[len(gaps) // 2] if gaps else 0.0)  # step 0's flow-run start-up
    if gaps:  # what the workflow costs between steps, tail included
        print(f"rollflow between steps (a commit to the next step's first task): median "
              f"{gaps[len(gaps) // 2]:.2f} s, max {gaps[-1]:.2f} s, "
              f"{sum(g > 1.5 for g in gaps)} of {len(gaps)} over 1.5 s")
    samples, points, ckpts = 0, [Point(0, 0.0, 0.0)], [sft_ckpt]
    saving = 0.0  # seconds spent saving the snapshots: off the clock, as TRL's copies are
    for step, done in zip(steps, committed, strict=True):
        metrics = json.loads((step / "metrics.json").read_text())
        samples += int(metrics.get("train/num_samples", per_step))
        ckpt = run_dir / "checkpoints" / step.name
        if (ckpt / "model.safetensors").exists():
            saving += float(metrics.get("time/commit", 0.0))
            points.append(Point(samples, done - t0 - saving, meter.at(done) - meter.at(t0)))
            ckpts.append(str(ckpt))
    end = committed[-1]
    return Curve("rollflow", points, t0 - called, end - t0 - saving,
                 meter.at(end) - meter.at(t0), meter.by_role(t0, end)), ckpts


def with_accuracy(curve: Curve, accuracies: list[float]) -> Curve:
    points = [Point(p.samples, p.seconds, p.cpu, a)
              for p, a in zip(curve.points, accuracies, strict=True)]
    return Curve(curve.name, points, curve.startup, curve.seconds, curve.cpu,
                 curve.cpu_by_process)


def time_to(curve: Curve, accuracy: float) -> Point | None:
    """The first evaluated point at or above `accuracy` (None: never reached)."""
    return next((p for p in curve.points if p.accuracy >= accuracy - 1e-9), None)


def report_curves(curves: list[Curve]) -> dict[str, Any]:
    print("\n=== held-out exact match (500 problems, greedy) during training ===")
    print(f"{'run':<16} {'samples':>8} {'seconds':>8} {'cpu s':>8} {'acc %':>6}")
    for c in curves:
        for p in c.points:
            print(f"{c.name:<16} {p.samples:>8} {p.seconds:>8.1f} {p.cpu:>8.1f} "
                  f"{100 * p.accuracy:>6.1f}")
        print(f"{c.name:<16} start-up {c.startup:.1f} s; training {c.seconds:.1f} s wall, "
              f"{c.cpu:.1f} s CPU")
        if c.cpu_by_process:
            parts = sorted(c.cpu_by_process.items(), key=lambda kv: -kv[1])
            print(f"{'':<16} CPU by process: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts))
    return {}


SETTLED_SNAPSHOTS = 3


def settled_accuracy(curve: Curve, last: int = SETTLED_SNAPSHOTS) -> float:
    """The mean accuracy of a run's last `last` snapshots. One snapshot of 500 problems moves
    by a point or two from the next (bench/RESULTS.md, "vs TRL"), so "the final
    accuracy" read off one snapshot is partly the luck of where the run stopped."""
    tail = [p.accuracy for p in curve.points[1:]][-last:]
    return sum(tail) / len(tail) if tail else curve.points[-1].accuracy


def time_ratio(ours: Point | None, theirs: Point | None) -> tuple[float, float] | None:
    """(wall, CPU) ratios of the first points at a level, or None where a side missed it."""
    if not (ours and theirs and theirs.seconds and theirs.cpu):
        return None
    return ours.seconds / theirs.seconds, ours.cpu / theirs.cpu


def report(curves: list[Curve], trl: Curve, rollflow: Curve) -> dict[str, Any]:
    report_curves(curves)
    final = trl.points[-1].accuracy
    settled = settled_accuracy(trl)
    levels = sorted({round(x / 100, 2) for x in range(60, 100, 5)} | {final})
    print("\n=== time to accuracy (s; first evaluated point at or above) ===")
    print(f"{'acc %':>6} " + " ".join(f"{c.name:>16}" for c in curves))
    table = []
    for level in levels:
        if level <= trl.points[0].accuracy:
            continue
        hits = [time_to(c, level) for c in curves]
        row = " ".join(f"{p.seconds:>16.1f}" if p else f"{'-':>16}" for p in hits)
        print(f"{100 * level:>6.1f} {row}")
        table.append({"accuracy": level, **{c.name: (p.seconds if p else None)
                                            for c, p in zip(curves, hits, strict=True)}})
    ours, theirs = time_to(rollflow, final), time_to(trl, final)
    ratio, cpu_ratio = time_ratio(ours, theirs) or (None, None)
    with_startup = ((ours.seconds + rollflow.startup) / (theirs.seconds + trl.startup)
                    if ours and theirs else None)
    shown = (f"{ratio:.2f}x wall, {cpu_ratio:.2f}x CPU ({with_startup:.2f}x wall counting "
             f"start-up)" if ratio and cpu_ratio and with_startup else "not reached")
    print(f"\nrollflow time / {trl.name} time to {trl.name}'s final {100 * final:.1f}%: {shown}")
    settled_ratio = time_ratio(time_to(rollflow, settled), time_to(trl, settled))
    settled_shown = (f"{settled_ratio[0]:.2f}x wall, {settled_ratio[1]:.2f}x CPU"
                     if settled_ratio else "not reached")
    print(f"rollflow time / {trl.name} time to {trl.name}'s settled {100 * settled:.1f}% (mean "
          f"of its last {SETTLED_SNAPSHOTS} snapshots): {settled_shown}")
    return {"time_to_accuracy": table, "final_trl_accuracy": final, "ratio": ratio,
            "cpu_ratio": cpu_ratio, "ratio_with_startup": with_startup,
            "settled_trl_accuracy": settled,
            "settled_ratio": settled_ratio[0] if settled_ratio else None,
            "settled_cpu_ratio": settled_ratio[1] if settled_ratio else None}


def plot(curves: list[Curve], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_samples) = plt.subplots(1, 2, figsize=(11, 4))
    for c in curves:
        acc = [100 * p.accuracy for p in c.points]
        by_time.plot([p.seconds for p in c.points], acc, marker="o", label=c.name)
        by_samples.plot([p.samples for p in c.points], acc, marker="o", label=c.name)
    by_time.set(xlabel="training seconds (wall)", ylabel="held-out exact match %")
    by_samples.set(xlabel="training samples", ylabel="held-out exact match %")
    for ax in (by_time, by_samples):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("arithmetic GRPO from the same SFT checkpoint: rollflow vs TRL")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="./runs", help="storage root (SFT run reused here)")
    parser.add_argument("--artifacts", default=None, help="data + model dir (the example's)")
    parser.add_argument("--samples", type=int, default=38400,
                        help="generated samples each side trains on (TRL: samples / 64 steps; "
                        "rollflow: rollout steps rounded up, unless --set rollout.num_rollout)")
    parser.add_argument("--trl-lr", default="1e-4", help="TRL learning rate(s), comma-separated"
                        "; the first is the one the ratio is against; '' runs rollflow alone")
    parser.add_argument("--trl-iterations", type=int, default=1,
                        help="TRL num_iterations (its PPO epochs per generation batch)")
    parser.add_argument("--snapshot-every", type=int, default=2048,
                        help="samples between evaluated snapshots (both sides)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of TRL and of each rollflow actor (cluster."
                        "actor_num_threads), the same on both sides; default: torch's default "
                        "here (all cores). On a loaded machine use 1: torch's OpenMP threads "
                        "spin, and 2 threads on 2 busy cores run many times slower than 1")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override for rollflow's GRPO phase, e.g. train.lr=2e-4")
    args = parser.parse_args()
    prefect_env_defaults()  # the main job's Prefect settings (examples/arithmetic/run.py)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    out = Path(args.runs) / "vs_trl"
    out.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()}; torch threads, both sides: {threads}")

    from examples.arithmetic.run import HERE

    data, model = prepare_artifacts(args.artifacts or str(HERE / "artifacts"))
    # The main job's Prefect server, as in examples/arithmetic/run.py.
    with local_prefect_api(), stopping_a_new_head():
        _, sft_ckpt = run_sft(sft_config(args.runs, data, model))
        train_rows, test_rows = read_rows(data["train"]), read_rows(data["test"])
        max_new = grpo_config(args.runs, data, sft_ckpt, args.set).rollout.max_response_len

        trl_runs, trl_startup = [], []
        for lr in (float(x) for x in args.trl_lr.split(",") if x):
            t = time.perf_counter()
            trl_runs.append(run_trl(sft_ckpt, train_rows, lr=lr,
                                    steps=args.samples * args.trl_iterations // 64,
                                    snapshot_every=args.snapshot_every,
                                    max_completion_length=max_new,
                                    num_iterations=args.trl_iterations))
            trl_startup.append(time.perf_counter() - t - trl_runs[-1].seconds)
        ours, ckpts = rollflow_run(args.runs, data, sft_ckpt, args.snapshot_every, threads,
                                   args.set, args.samples)
    print(f"load average after: {os.getloadavg()}; evaluating the snapshots ...")

    from transformers import AutoModelForCausalLM

    def from_disk(path: str) -> Any:
        return lambda: AutoModelForCausalLM.from_pretrained(path).state_dict()

    ours = with_accuracy(ours, evaluate_states(sft_ckpt, [from_disk(c) for c in ckpts],
                                               test_rows, max_new))
    curves = []
    for run, startup in zip(trl_runs, trl_startup, strict=True):
        states = [from_disk(sft_ckpt)] + [(lambda s=s: s.state) for s in run.snapshots]
        curves.append(trl_curve(run, evaluate_states(sft_ckpt, states, test_rows, max_new),
                                startup))
    curves.append(ours)
    summary = report(curves, curves[0], ours) if trl_runs else report_curves(curves)
    plot(curves, out / "curves.png")
    results = {"load_average_end": os.getloadavg(), "threads": threads,
               "rollflow_overrides": args.set, **summary,
               "curves": [{"name": c.name, "startup": c.startup, "seconds": c.seconds,
                           "cpu": c.cpu, "cpu_by_process": c.cpu_by_process,
                           "points": [vars_of(p) for p in c.points]}
                          for c in curves]}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"curves: {out / 'curves.png'}\nresults: {out / 'results.json'}")


def vars_of(p: Point) -> dict[str, float]:
    return {"samples": p.samples, "seconds": p.seconds, "cpu": p.cpu, "accuracy": p.accuracy}


if __name__ == "__main__":
    main()
