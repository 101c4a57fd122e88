"""Where the CPU of the main job's GRPO phase goes: by process, and inside each by what it does.

The GRPO phase of the main job (examples/arithmetic/grpo.yaml from the SFT checkpoint that
`scripts/main.sh` wrote under `--runs`) runs in a child process, which starts the Ray head
itself (`ray.init`) and a local Prefect server. This process reads the CPU seconds of every
process under it from the OS (psutil, every half second) and attaches a `py-spy record` to
each Python process that does the run's work (the driver, the Prefect server, and each Ray
actor once it is one: Ray starts a worker through an exec, which `py-spy --subprocesses`
does not follow). A py-spy sample is one stack of one running Python thread, so a part's
share of a process's samples is the share of its Python time; torch's own worker threads
are not Python threads, so the CPU seconds are the OS's. Ray's C++ daemons (raylet, GCS)
are in the OS figures only.

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
         ("prefect_app", "prefect server"), ("grpo_profile", "driver")]


def kind_of(command_line: str, name: str = "") -> str:
    """A process's kind from its command line (a Ray worker's is its title, ray::<class>...)."""
    if command_line.startswith("ray::"):
        return next((k for key, k in KINDS[:3] if key in command_line), "ray worker start-up")
    if "ray/_private/workers/" in command_line:
        return "ray worker start-up"
    if name in ("raylet", "gcs_server") or "/ray/" in command_line:
        return "ray daemons"
    return next((k for key, k in KINDS[3:] if key in command_line), "other")


def parts_of(raw: Path, kind: str, rate: float) -> collections.Counter[str]:
    """Seconds of Python time per part (PARTS[kind]) from one process's py-spy raw stacks."""
    out: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        part = next((name for name, pattern in PARTS.get(kind, [])
                     if any(re.search(pattern, f) for f in frames)), "other")
        out[part] += int(count) / rate
    return out


class Watcher:
    """Every `interval_s`: each process under `root` (its CPU seconds, by kind), and a py-spy
    attached to each new one of the kinds in PARTS (a start-up's CPU stays start-up; a
    process that starts and ends between two looks is missed)."""

    def __init__(self, root: int, spy: str, rate: int, work: Path, interval_s: float = 0.5) -> None:
        self.root, self.spy, self.rate, self.work, self.interval_s = root, spy, rate, work, interval_s
        self.kinds: dict[tuple[int, float], str] = {}  # process -> its kind
        self.cpu: dict[tuple[int, float], float] = {}  # process -> CPU seconds at the last look
        self.startup: dict[tuple[int, float], float] = {}  # an actor's worker start-up seconds
        self.spies: list[tuple[str, Path, subprocess.Popen[bytes]]] = []

    def poll(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.root)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for proc in procs:
            try:
                key = (proc.pid, proc.create_time())
                times = proc.cpu_times()
                kind = kind_of(" ".join(proc.cmdline()), proc.name())
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            total = times.user + times.system
            seen = self.kinds.get(key)
            if seen is None or (seen == "ray worker start-up" and kind != seen):
                if seen is not None:  # a worker became an actor: its start-up stays apart
                    self.startup[key] = self.cpu.get(key, 0.0)
                self.kinds[key] = kind
                self._attach(proc.pid, kind)
            self.cpu[key] = total

    def _attach(self, pid: int, kind: str) -> None:
        if kind not in PARTS:
            return
        out = self.work / f"{kind.replace(' ', '_')}-{pid}.raw"
        self.spies.append((kind, out, subprocess.Popen(
            [self.spy, "record", "--pid", str(pid), "--rate", str(self.rate), "--format", "raw",
             "--nonblocking", "-o", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))

    def cpu_by_kind(self) -> collections.Counter[str]:
        out: collections.Counter[str] = collections.Counter()
        for key, seconds in self.cpu.items():
            start = self.startup.get(key, 0.0)
            out[self.kinds[key]] += seconds - start
            out["ray worker start-up"] += start
        return out

    def parts_by_kind(self) -> dict[str, collections.Counter[str]]:
        out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for kind, raw, spying in self.spies:
            try:
                spying.wait(timeout=30)  # it writes its file once its process has exited
            except subprocess.TimeoutExpired:
                spying.terminate()
                spying.wait()
            if raw.exists():
                out[kind].update(parts_of(raw, kind, self.rate))
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
    parser.add_argument("--keep", default=None, help="also copy py-spy's raw stacks to this folder")
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
    wall = work / "wall_s"
    inner = [sys.executable, "-m", "bench.grpo_profile", "--inner", "--runs", args.runs,
             "--wall-file", str(wall), *(["--steps", str(args.steps)] if args.steps else []),
             *(x for s in args.set for x in ("--set", s))]
    running = subprocess.Popen(inner, env={**os.environ, "PYTHONPATH": str(REPO)})
    watcher = Watcher(running.pid, spy, args.rate, work)
    while running.poll() is None:
        watcher.poll()
        time.sleep(watcher.interval_s)
    if running.returncode != 0:
        raise SystemExit(f"the profiled GRPO phase exited {running.returncode}")
    parts = watcher.parts_by_kind()
    if args.keep:
        shutil.copytree(work, args.keep, dirs_exist_ok=True)
    report(parts, watcher.cpu_by_kind(), float(wall.read_text()))


if __name__ == "__main__":
    main()
