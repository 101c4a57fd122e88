"""Time to a held-out accuracy in each rollout mode (`rollout.mode`) on a long-tailed job.

The main job's two-digit addition, with a tail of dots after the answer whose length depends
on the problem: a problem whose second number ends in 0 (one in ten; `--long-when ab`: both
numbers, one in a hundred) is answered with 40 dots after it (`--long-dots`), the others with
0 to 3 (`work_dots`), so response lengths spread more than 10x (the bench prints the spread
it measured) and a synchronous step waits for its stragglers. An SFT warm start
on such answers (the main job's sft.yaml), then GRPO (grpo.yaml). With `--reward tail` (the
default) a long problem's answer scores only with the right sum and at least half its dots
(`tail_score`), so the tail is part of the task, as a long chain of thought is, and a policy
cannot make its stragglers vanish by dropping it (with `--reward last_number` the dots were
free, and one GPU run's async policy dropped them sooner than its sync run: bench/RESULTS.md).

Each mode is one `rollflow train` from the shell, all sharing one local head. A run's clock
starts when its step 0 starts (so start-up is not in it) and a weight version counts as
reached when the step that trained it committed; the held-out set is scored every
`--eval-every` steps. By default each run scores it itself, inside its clock (an evaluation
blocks the step that ends on it). With `--offline-eval` the runs save a checkpoint every
`--eval-every` steps instead, and the bench scores the checkpoints after the last run, off
the runs' clocks, as bench.vs_trl does: greedy HF decoding, the runs' last-number rule. The
checkpoints' own saving stays in each clock.

    python -m bench.async_rl
    python -m bench.async_rl --modes sync,async:2 --steps 8

Figures: bench/RESULTS.md, "Async RL".
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from engines.rollout.rewards.text_rules import last_number_score
from examples.arithmetic.build_model import save_tiny_model
from examples.arithmetic.make_data import make_row, split_pairs
from storage.batch_io import read_samples
from storage.run_layout import RunLayout, step_dir
from storage.sample import Sample

REPO = Path(__file__).resolve().parents[1]
# Where a step's time goes, per mode (the means of each step's metrics): the generate task
# (in async mode, the wait for the step's groups: `rollout/async_wait_s` of it), the train
# task, the weight push, the commit; "interval" is commit to commit, and what it has beyond
# the tasks is the flow's own work and evaluation. Also the samples of stale groups started over.
BREAKDOWN = {"generate": "time/generate", "async wait": "rollout/async_wait_s",
             "train": "time/train", "w-sync": "time/broadcast_weights",
             "commit": "time/commit", "stale samples redone": "rollout/groups_stale_regenerated_samples"}


@dataclass
class ModeRun:
    mode: str
    staleness: int
    reached_s: dict[int, float]  # weight version -> seconds from step 0's start
    accuracy: dict[int, float]  # weight version -> held-out accuracy (%)
    lengths: list[int]  # every trained response's length
    long_lengths: list[int]  # those of the long problems' responses (`is_long`)
    wall_s: float  # step 0's start to the last commit
    per_step: dict[str, float]  # mean seconds per step: the interval and each task (BREAKDOWN)

    def time_to(self, target: float) -> float | None:
        hits = [self.reached_s[v] for v, acc in sorted(self.accuracy.items())
                if acc >= target and v in self.reached_s]
        return hits[0] if hits else None


def is_long(a: int, b: int, when: str = "b") -> bool:
    """Whether a+b gets the long answer: "b" when b ends in 0 (one problem in ten, cued by
    the last digit before "="); "ab" when both numbers end in 0 (one in a hundred: fewer
    long answers in the warm start's loss, for a tail of 1,000 dots)."""
    return b % 10 == 0 and (when == "b" or a % 10 == 0)


SHORT_DOTS = 4  # a short problem's answer has 0 to SHORT_DOTS - 1 dots


def work_dots(a: int, b: int, long: int = 40, when: str = "b") -> int:
    """The dots after the answer to a+b: `long` for a long problem (`is_long`), else 0 to 3."""
    return long if is_long(a, b, when) else (a + b) % SHORT_DOTS


def is_long_prompt(prompt: object, when: str) -> bool:
    """`is_long` of a trained sample's "a+b=" prompt."""
    a, _, b = str(prompt).rstrip("=").partition("+")
    return a.isdigit() and b.isdigit() and is_long(int(a), int(b), when)


def tail_score(response: str, label: str | None) -> float:
    """`--reward tail`: 1.0 when the last number of `response` is the sum and, for a long
    problem, at least half the dots of `label` (the SFT answer: the sum, then its dots) follow
    it. A short problem's few dots stay free: the task is the sum and the long tail."""
    if label is None:
        return 0.0
    total = label.rstrip(".")
    dots = len(label) - len(total)
    digits = [i for i, c in enumerate(response) if c.isdigit()]
    tail = response[digits[-1] + 1:].count(".") if digits else 0
    needed = dots // 2 if dots >= SHORT_DOTS else 0
    return last_number_score(response, total) if tail >= needed else 0.0


async def tail_reward(args: Any, sample: Sample) -> float:
    """`tail_score` as the runs' reward (`rollout.custom_rm_path`)."""
    return tail_score(sample.response, sample.label)


def write_long_tail_data(out: Path, long: int, when: str = "b", n_train: int = 4000,
                         n_test: int = 500, dotted_labels: bool = True) -> Path:
    """train/test and sft jsonl files. sft's label is the answer: the sum, then the dots;
    train's and test's is the same (`dotted_labels`, for `tail_score`) or the sum alone."""
    out.mkdir(parents=True, exist_ok=True)
    train, test = split_pairs(n_train, n_test, seed=0)

    def write(name: str, pairs: list[tuple[int, int]], dotted: bool) -> None:
        rows = [{**make_row(a, b), "label": str(a + b) + "." * work_dots(a, b, long, when)}
                if dotted else make_row(a, b) for a, b in pairs]
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("train", train, dotted_labels)
    write("test", test, dotted_labels)
    write("sft", train, True)
    return out


def reward_settings(args: argparse.Namespace) -> list[str]:
    """The reward of the warm start's and the runs' evaluations and of the runs (`--reward`)."""
    if args.reward == "tail":
        return ["rollout.custom_rm_path=bench.async_rl:tail_reward"]
    return ["rollout.rm_type=last_number"]


def score_rule(args: argparse.Namespace) -> Callable[[str, str], float]:
    """The offline scoring's rule: the runs' reward."""
    return tail_score if args.reward == "tail" else last_number_score


def warm_start(args: argparse.Namespace, data: Path, runs: Path, env: dict[str, str]) -> Path:
    """The SFT checkpoint: sft.yaml on the long-tailed answers, from a fresh tiny model."""
    model = save_tiny_model(str(runs.parent / f"{runs.name}-tiny-llama"),
                            max_positions=max(128, args.max_response_len + 32))
    sets = [f"data.prompt_data={data / 'sft.jsonl'}", f"train.model_path={model}",
            f"rollout.max_response_len={args.max_response_len}", *reward_settings(args),
            f"eval.datasets=[{{name: test, path: {data / 'test.jsonl'}, temperature: 0.0}}]",
            f"storage.uri={runs}", "storage.run_name=async-rl-sft", "logging.progress=false",
            f"rollout.num_rollout={args.sft_steps}"]
    run([sys.executable, "-m", "flows.cli", "train", "--config",
         str(REPO / "examples/arithmetic/sft.yaml"), *(x for s in sets for x in ("--set", s))],
        env, "sft")
    return runs / "async-rl-sft" / "checkpoints" / f"{args.sft_steps - 1:06d}"


def eval_model(path: str) -> Any:
    """A checkpoint for the bench's greedy scoring: float32, on the GPU where there is one."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)


def warm_start_tail(checkpoint: Path, test: Path, when: str, max_new_tokens: int,
                    prompts: int = 100) -> float:
    """The mean count of dots in the warm start's greedy answers to the first `prompts`
    long held-out problems: the long tail GRPO will start from (the SFT answer has
    `--long-dots`). The same 16-step warm start learnt it in some GPU invocations and not in
    others (bench/RESULTS.md, "Async RL")."""
    from transformers import AutoTokenizer

    from bench.trl_baseline import greedy_completions

    rows = [json.loads(line) for line in test.read_text().splitlines()]
    long = [r["prompt"] for r in rows if is_long_prompt(r["prompt"], when)][:prompts]
    if not long:
        return 0.0
    texts = greedy_completions(eval_model(str(checkpoint)),
                               AutoTokenizer.from_pretrained(str(checkpoint)), long,
                               max_new_tokens, batch_size=len(long))
    return statistics.fmean(t.count(".") for t in texts)


def run(cmd: list[str], env: dict[str, str], what: str) -> None:
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{what}: rollflow train exited {done.returncode}")


def parse_mode(text: str) -> tuple[str, int]:
    mode, _, eta = text.partition(":")
    return mode, int(eta or 1)


def command(args: argparse.Namespace, mode: str, eta: int, data: Path, checkpoint: Path,
            runs: Path) -> list[str]:
    sets = [
        f"train.model_path={checkpoint}", *reward_settings(args),
        f"data.prompt_data={data / 'train.jsonl'}",
        *eval_settings(args, data),
        f"rollout.num_rollout={args.steps if mode == 'sync' else args.overlap_steps or args.steps}",
        f"rollout.rollout_batch_size={args.groups}",
        f"rollout.max_response_len={args.max_response_len}",
        f"rollout.mode={mode}", f"rollout.max_staleness={eta}",
        f"storage.uri={runs}", f"storage.run_name=async-rl-{mode}-{eta}-{uuid.uuid4().hex[:6]}",
        "logging.progress=false", *args.set,
    ]
    return [sys.executable, "-m", "flows.cli", "train", "--config",
            str(REPO / "examples/arithmetic/grpo.yaml"), *(x for s in sets for x in ("--set", s))]


def eval_settings(args: argparse.Namespace, data: Path) -> list[str]:
    """The run's own evaluations every --eval-every steps, or (--offline-eval) none, and a
    checkpoint every --eval-every steps for `offline_accuracy`."""
    if args.offline_eval:
        return ["eval.datasets=[]", "eval.before_train=false",
                f"train.save_interval={args.eval_every}"]
    return [f"eval.datasets=[{{name: test, path: {data / 'test.jsonl'}, temperature: 0.0, "
            f"max_prompts: {args.eval_prompts}}}]", f"eval.eval_interval={args.eval_every}"]


def offline_accuracy(
    layout: RunLayout, warm_start_ckpt: Path, test: Path, prompts: int, max_new_tokens: int,
    score: Callable[[str, str], float],
) -> dict[int, float]:
    """Held-out accuracy (%) of each weight version the run checkpointed (a checkpoint of
    step k holds version k + 1), and of version 0, the warm start: greedy HF decoding of the
    first `prompts` test rows, scored by `score` (the runs' reward)."""
    from transformers import AutoTokenizer

    from bench.trl_baseline import greedy_accuracy

    rows = [json.loads(line) for line in test.read_text().splitlines()[:prompts]]
    tokenizer = AutoTokenizer.from_pretrained(str(warm_start_ckpt))
    ckpts = {0: str(warm_start_ckpt)}
    ckpts.update({int(name) + 1: layout.store.path("checkpoints", name)
                  for name in layout.store.list("checkpoints") if name.isdigit()})
    out = {}
    for version, path in sorted(ckpts.items()):
        out[version] = 100.0 * greedy_accuracy(eval_model(path), tokenizer, rows, max_new_tokens,
                                               batch_size=max(1, len(rows)), score=score)
    return out


def _seconds(stamp: str | float) -> float:
    return float(stamp) if isinstance(stamp, (int, float)) else datetime.fromisoformat(stamp).timestamp()


def measure(layout: RunLayout, mode: str, eta: int, accuracy: dict[int, float] | None = None,
            long_when: str = "b") -> ModeRun:
    """The run's times from its stored records; `accuracy` by version (%), else the run's
    own evaluations."""
    steps = layout.committed_steps()
    start = _seconds(layout.task_record(0, "sample_prompts")["started_at"])  # type: ignore[index]
    reached = {k + 1: _seconds(layout.store.read_json(step_dir(k), "COMMITTED")["committed_at"])
               - start for k in steps}
    if accuracy is None:
        accuracy = {v: 100.0 * m["eval/test"] for v, m in layout.evals().items()}
    trained = [s for k in steps for s in read_samples(layout.store, step_dir(k), "train.arrow")]
    lengths = [s.response_length for s in trained]
    long_lengths = [s.response_length for s in trained if is_long_prompt(s.prompt, long_when)]
    metrics = [layout.step_metrics(k) for k in steps]
    per_step = {name: statistics.fmean(m.get(key, 0.0) for m in metrics)
                for name, key in BREAKDOWN.items()}
    ends = sorted(reached.values())
    per_step["interval"] = statistics.fmean(b - a for a, b in itertools.pairwise([0.0, *ends]))
    return ModeRun(mode, eta, reached, accuracy, lengths, long_lengths, max(reached.values()),
                   per_step)


def report(runs: list[ModeRun], target: float | None) -> None:
    """The table; the target defaults to the sync run's final accuracy, and each run's
    time to it is also given as a fraction of the sync run's time to it (vs sync) and of the
    sync run's wall time (issue 46's measure); the long problems' share of the trained
    samples shows whether a mode trains its stragglers as often as it draws them."""
    sync = next((r for r in runs if r.mode == "sync"), None)
    if target is None:
        target = sync.accuracy[max(sync.accuracy)] if sync is not None else 0.0
    sync_hit = sync.time_to(target) if sync is not None else None
    print(f"\ntarget held-out accuracy {target:.1f}%")
    print("| mode | η | wall (s) | to target (s) | vs sync | vs sync wall | final accuracy "
          "| response length p50 / p99 / max | long problems: share, mean length |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        lengths = sorted(r.lengths)
        p = statistics.quantiles(lengths, n=100) if len(lengths) > 1 else lengths * 99
        hit = r.time_to(target)
        final = r.accuracy[max(r.accuracy)]
        eta = "-" if r.mode == "sync" else str(r.staleness)
        ratio = f"{hit / sync_hit:.2f}x" if hit is not None and sync_hit else "-"
        of_wall = f"{hit / sync.wall_s:.2f}x" if hit is not None and sync is not None else "-"
        long = (f"{len(r.long_lengths) / len(lengths):.1%}, "
                f"{statistics.fmean(r.long_lengths):.0f}" if r.long_lengths else "0%")
        print(f"| {r.mode} | {eta} | {r.wall_s:.1f} | {'not reached' if hit is None else f'{hit:.1f}'} "
              f"| {ratio} | {of_wall} | {final:.1f}% | {p[49]:.0f} / {p[98]:.0f} / {lengths[-1]} "
              f"| {long} |")
    print("\nper step, mean (s; the stale samples redone: a count)")
    names = ["interval", *BREAKDOWN]
    print("| mode | η | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for r in runs:
        eta = "-" if r.mode == "sync" else str(r.staleness)
        print(f"| {r.mode} | {eta} | " + " | ".join(f"{r.per_step[n]:.2f}" for n in names) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="sync,one_step:1,async:1,async:2,async:4")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--overlap-steps", type=int, default=None,
                        help="the one_step and async runs' steps (default: --steps): time to the "
                        "sync run's final accuracy may need more of their steps than sync's")
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--max-response-len", type=int, default=48)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="more overrides of every GRPO run (e.g. train.weight_sync=distributed)")
    parser.add_argument("--long-dots", type=int, default=40,
                        help="the long answers' dots (a GPU run: e.g. 400, --max-response-len 448)")
    parser.add_argument("--reward", choices=("tail", "last_number"), default="tail",
                        help="tail: the right sum and at least half its dots (`tail_score`); "
                        "last_number: the sum alone, the dots free")
    parser.add_argument("--long-when", choices=("b", "ab"), default="b",
                        help="which problems get the long answer: b ends in 0 (1 in 10), or "
                        "both numbers end in 0 (1 in 100)")
    parser.add_argument("--sft-steps", type=int, default=5,
                        help="the warm start's steps (sft.yaml's 5: a GPU run may need more "
                        "to learn which problems get the long answer)")
    parser.add_argument("--min-tail", type=float, default=0.5,
                        help="stop before the runs when the warm start's greedy answers to the "
                        "long problems average fewer dots than this fraction of --long-dots")
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--test-prompts", type=int, default=500,
                        help="held-out problems written (at most 8100 - 4000 train)")
    parser.add_argument("--offline-eval", action="store_true",
                        help="score checkpoints after the runs, off their clocks (see above)")
    parser.add_argument("--target", type=float, default=None,
                        help="held-out accuracy, %% (default: the sync run's final one)")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="rf-async-rl-", dir="/tmp"))
    runs_root = Path(tempfile.mkdtemp(prefix="rf-async-rl-runs-"))
    env = {**os.environ, "ROLLFLOW_HOME": str(home), "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "TOKENIZERS_PARALLELISM": "false"}
    results: list[ModeRun] = []
    done: list[tuple[str, str, int, RunLayout]] = []
    try:
        data = write_long_tail_data(runs_root.parent / f"{runs_root.name}-data", args.long_dots,
                                    args.long_when, n_test=args.test_prompts,
                                    dotted_labels=args.reward == "tail")
        t0 = time.perf_counter()
        checkpoint = warm_start(args, data, runs_root, env)
        tail = warm_start_tail(checkpoint, data / "test.jsonl", args.long_when,
                               args.max_response_len)
        print(f"warm start ({time.perf_counter() - t0:.0f} s, its check included): its greedy "
              f"answers to the long problems end with {tail:.0f} dots on average (the SFT "
              f"answer has {args.long_dots})", flush=True)
        if tail < args.min_tail * args.long_dots:
            raise SystemExit(
                f"the warm start did not learn the long answers ({tail:.0f} dots on average, "
                f"under --min-tail {args.min_tail} x {args.long_dots}): the runs would have no "
                f"long tail to compare the modes on; give more --sft-steps")
        for text in args.modes.split(","):
            mode, eta = parse_mode(text)
            cmd = command(args, mode, eta, data, checkpoint, runs_root)
            t0 = time.perf_counter()
            run(cmd, env, text)
            print(f"{text}: rollflow train {time.perf_counter() - t0:.0f} s, start-up included",
                  flush=True)
            run_name = next(a.split("=", 1)[1] for a in cmd if a.startswith("storage.run_name="))
            done.append((text, mode, eta, RunLayout.open(str(runs_root), run_name)))
    finally:
        subprocess.run([sys.executable, "-m", "flows.cli", "cluster", "down", "--force"],
                       cwd=REPO, env=env, capture_output=True)
    for text, mode, eta, layout in done:  # (offline: the head is down, the devices free)
        accuracy = None
        if args.offline_eval:
            t0 = time.perf_counter()
            accuracy = offline_accuracy(layout, checkpoint, data / "test.jsonl",
                                        args.eval_prompts, args.max_response_len,
                                        score_rule(args))
            print(f"{text}: offline evaluation {time.perf_counter() - t0:.0f} s", flush=True)
        results.append(measure(layout, mode, eta, accuracy, args.long_when))
        r = results[-1]
        print(f"{text}: {r.wall_s:.1f} s; (version, s, accuracy %): "
              f"{[(v, round(r.reached_s.get(v, 0.0), 1), round(a, 1)) for v, a in sorted(r.accuracy.items())]}",
              flush=True)
    report(results, args.target)


if __name__ == "__main__":
    main()
