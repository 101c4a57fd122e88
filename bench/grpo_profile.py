"""Where the CPU of the main job's GRPO phase goes: by process, and inside each by what it does.

The GRPO phase of the main job (examples/arithmetic/grpo.yaml from the SFT checkpoint that
`scripts/main.sh` wrote under `--runs`) runs in a child process under py-spy
(`record --subprocesses --format raw`). That process starts the Ray head itself (`ray.init`)
and a local Prefect server, so every actor and the server are processes py-spy follows. Each sample is one
stack of one Python thread on a CPU (py-spy leaves idle threads out), so samples / rate is
seconds of Python threads running; torch's own worker threads are not Python threads, so each
process's CPU seconds are also read from the OS (psutil, every half second), and its parts
are given as shares of its samples. Ray's C++ daemons (raylet, GCS) are in the OS figures
only.

Inside a process, a sample goes to the first part whose frame is on its stack (PARTS below:
the trainer's forward, backward, old log-probs, optimizer; the engine's prefill, decode,
sampling; the Prefect server's database and events; the driver's Prefect client and Ray
calls); the rest is "other".

    pip install py-spy   # not a dependency of rollflow
    python -m bench.grpo_profile                 # the whole phase (grpo.yaml's steps)
    python -m bench.grpo_profile --steps 10 --set train.deterministic=false

Figures: bench/RESULTS.md, "GRPO phase profile".
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# process kind -> [(part, pattern of a frame on the stack)], first match wins
PARTS: dict[str, list[tuple[str, str]]] = {
    "trainer": [
        ("old log-probs (prepare_batch)", r"^prepare_batch \(engines/train/"),
        ("backward", r"^(Tensor\.backward|_engine_run_backward|backward) \(torch/"),
        ("optimizer", r"\(torch/optim/"),
        ("weights out (export, push)", r"\(engines/weights/"),
        ("forward (loss pass)", r"^optimizer_step \(engines/train/"),
        ("checkpoint", r"\(engines/train/checkpoint"),
    ],
    "engine": [
        ("prefill", r"^EmbeddedGenerator\._prefill "),
        ("sampling", r"^EmbeddedGenerator\._sample "),
        ("decode", r"^EmbeddedGenerator\._decode "),
        ("weights in", r"^EmbeddedGenerator\.(load_weights|update_weights)"),
        ("HTTP server", r"\((uvicorn|starlette|fastapi|h11|httptools)/"),
    ],
    "rollout": [
        ("rewards", r"\(engines/rollout/rewards/"),
        ("sample files (Arrow)", r"\((storage|pyarrow)/"),
        ("HTTP client", r"\((aiohttp|httpx)/"),
    ],
    "prefect server": [
        ("database", r"\((sqlalchemy|aiosqlite|asyncpg|alembic)/"),
        ("events", r"\(prefect/server/(events|services)/"),
        ("HTTP (API, middleware)", r"\((uvicorn|starlette|fastapi)/"),
        ("imports", r"^_find_and_load "),
    ],
    "driver": [
        ("imports", r"^_find_and_load "),
        ("Prefect client, engine", r"\(prefect/"),
        ("Ray calls", r"\(ray/"),
        ("run bookkeeping", r"\(flows/bookkeeping/"),
    ],
}
KINDS = [("TrainActor", "trainer"), ("EngineActor", "engine"), ("RolloutManager", "rollout"),
         ("prefect.server", "prefect server"), ("grpo_profile", "driver")]


def kind_of(process: str) -> str:
    for key, kind in KINDS:
        if key in process:
            return kind
    return "ray worker start-up" if "workers/" in process else "other"


def aggregate(raw: Path, rate: float) -> dict[str, collections.Counter[str]]:
    """(process kind -> part -> CPU seconds) from py-spy's raw output. A Ray worker keeps
    the command line it started with (setup_worker.py ...), so its kind comes from the
    actor class in its frames."""
    out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        process = [f for f in frames if f.startswith("process ")][-1]
        code = [f for f in frames if not f.startswith("process ")]
        kind = kind_of(process)
        if kind in ("ray worker start-up", "other"):
            for frame in code:
                actor = next((k for name, k in KINDS[:3] if frame.startswith(f"{name}.")), None)
                if actor:
                    kind = actor
                    break
        part = next((name for name, pattern in PARTS.get(kind, [])
                     if any(re.search(pattern, f) for f in code)), "other")
        out[kind][part] += int(count) / rate
    return out


class CpuByKind:
    """CPU seconds (user + system) of every process under `root`, by kind, read every
    `interval_s` (a process that starts and ends between two reads is missed)."""

    def __init__(self, root: int, interval_s: float = 0.5) -> None:
        self.root, self.interval_s = root, interval_s
        self.last: dict[tuple[int, float], tuple[str, float]] = {}

    def _kind(self, proc: Any) -> str:
        line = " ".join(proc.cmdline())
        if line.startswith("ray::"):  # a Ray worker's title: ray::<actor class>.<method>
            return next((k for name, k in KINDS[:3] if name in line), "ray worker start-up")
        if "workers/" in line:
            return "ray worker start-up"
        if proc.name() in ("raylet", "gcs_server"):
            return "ray daemons"
        if "ray/" in line:
            return "ray daemons"
        return kind_of(line)

    def poll(self) -> None:
        import psutil

        try:
            procs = psutil.Process(self.root).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                key = (proc.pid, proc.create_time())
                times = proc.cpu_times()
                kind = self._kind(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            old = self.last.get(key)
            # a worker becomes an actor: its start-up stays start-up, the rest is the actor's
            self.last[key] = (kind if old is None or old[0] == "ray worker start-up" else old[0],
                              times.user + times.system)

    def totals(self) -> collections.Counter[str]:
        out: collections.Counter[str] = collections.Counter()
        for kind, seconds in self.last.values():
            out[kind] += seconds
        return out


def report(parts: dict[str, collections.Counter[str]], cpu: collections.Counter[str],
           wall_s: float) -> None:
    print(f"\nGRPO phase: {wall_s:.1f} s wall (the train flow), {sum(cpu.values()):.1f} CPU-s "
          "in all (OS), from start-up to exit")
    print("| process | CPU-s (OS) | Python thread-s (py-spy) | parts (share of its samples) |")
    print("|---|---|---|---|")
    for kind in sorted(set(cpu) | set(parts), key=lambda k: -cpu.get(k, 0.0)):
        counter = parts.get(kind, collections.Counter())
        sampled = sum(counter.values())
        detail = ", ".join(f"{name} {100 * s / sampled:.0f}%" for name, s in counter.most_common())
        print(f"| {kind} | {cpu.get(kind, 0.0):.1f} | {sampled:.1f} | {detail} |")


def sft_checkpoint(runs: Path) -> Path:
    """The main job's SFT checkpoint (its last step's), which `scripts/main.sh` made."""
    found = sorted((runs / "arithmetic-sft" / "checkpoints").glob("[0-9]*"))
    if not found:
        raise SystemExit(f"no SFT checkpoint under {runs}/arithmetic-sft: run scripts/main.sh first "
                         "(or --runs where it wrote its runs)")
    return found[-1]


def run_phase(args: argparse.Namespace) -> None:
    """The GRPO phase in this process, against a Ray head and a Prefect server started here."""
    import ray

    from engines.cluster.head import HEAD_ENV_DEFAULTS
    from examples.arithmetic.run import grpo_config, prepare_artifacts
    from flows.servers.prefect_env import prefect_env_defaults
    from flows.servers.prefect_server import local_prefect_api
    from flows.train import train

    prefect_env_defaults()
    for name, value in HEAD_ENV_DEFAULTS.items():
        os.environ.setdefault(name, value)
    runs = Path(args.runs).resolve()
    checkpoint = sft_checkpoint(runs)
    data, _ = prepare_artifacts(str(REPO / "examples" / "arithmetic" / "artifacts"))
    ctx = ray.init(address="local", include_dashboard=False, log_to_driver=False,
                   runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    extra = [f"cluster.address={ctx.address_info['gcs_address']}",
             f"storage.run_name=grpo-profile-{uuid.uuid4().hex[:6]}", "logging.progress=false",
             *([f"rollout.num_rollout={args.steps}"] if args.steps else []), *args.set]
    cfg = grpo_config(str(runs), data, str(checkpoint), extra)
    with local_prefect_api():
        start = time.perf_counter()
        train(cfg)
        Path(args.wall_file).write_text(f"{time.perf_counter() - start:.2f}")
    ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="runs", help="where the main job's runs are (or go)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: grpo.yaml's)")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--keep", default=None, help="also copy py-spy's raw stacks here")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--wall-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        run_phase(args)
        return
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy is not installed: pip install py-spy")
    work = Path(tempfile.mkdtemp(prefix="rf-grpo-profile-"))
    raw, wall = work / "stacks.raw", work / "wall_s"
    inner = [sys.executable, "-m", "bench.grpo_profile", "--inner", "--runs", args.runs,
             "--wall-file", str(wall), *(["--steps", str(args.steps)] if args.steps else []),
             *(x for s in args.set for x in ("--set", s))]
    spying = subprocess.Popen([spy, "record", "--subprocesses", "--format", "raw", "--rate",
                               str(args.rate), "--nonblocking", "-o", str(raw), "--", *inner],
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    cpu = CpuByKind(spying.pid)
    while spying.poll() is None:
        cpu.poll()
        time.sleep(cpu.interval_s)
    if spying.returncode != 0:
        raise SystemExit(f"the profiled GRPO phase exited {spying.returncode}")
    if args.keep:
        shutil.copy(raw, args.keep)
    report(aggregate(raw, args.rate), cpu.totals(), float(wall.read_text()))


if __name__ == "__main__":
    main()
