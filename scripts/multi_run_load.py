"""Many runs, one cluster: three trainings on one local Ray head at once (two mock runs and
a LoRA run on the embedded engine), with one driver killed -9 and then the head killed -9
while they run; the same three commands run again must resume each run and finish it with
exactly the samples of its solo run, and leave no actor or placement group behind.

    python scripts/multi_run_load.py [--out DIR]

Everything (the Ray head, a Prefect server, the runs) lives in a temporary ROLLFLOW_HOME and
directory of its own, on 127.0.0.1, and is stopped at the end. Prints one line per run:
its time alone, its time with the other two started beside it (and the slowdown), its time
with the faults (from the first start to the rerun's end), and whether its samples match its
solo run in both; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
HOME = Path(tempfile.mkdtemp(prefix="rf-multi-", dir="/tmp"))  # short: Ray's socket paths
os.environ.update(ROLLFLOW_HOME=str(HOME), RAY_AUTH_MODE="disabled",
                  PREFECT_SERVER_ANALYTICS_ENABLED="false", RAY_USAGE_STATS_ENABLED="0",
                  TOKENIZERS_PARALLELISM="false")
sys.path.insert(0, str(REPO))

from engines.cluster.head import cluster_address, stop_local_head  # noqa: E402
from engines.config.cluster import ClusterConfig  # noqa: E402
from engines.process import free_port  # noqa: E402
from flows.config.loader import dump_config  # noqa: E402
from flows.servers.prefect_server import start_server  # noqa: E402
from storage.run_layout import RunLayout  # noqa: E402
from tests.support.configs import arithmetic_config  # noqa: E402
from tests.support.server_faults import head_processes_of, kill_processes, trained_samples  # noqa: E402

HEAD_CPUS = 16  # logical: every actor of the three runs fits at once
# name -> (backend, overrides)
RUNS = {
    "mock-a": ("mock", ["rollout.num_rollout=6", "data.seed=3"]),
    "mock-b": ("mock", ["rollout.num_rollout=6", "data.seed=5"]),
    "lora": ("embedded", ["rollout.num_rollout=6", "train.lora.rank=8", "train.lora.alpha=16",
                          "train.lr=0.01", "train.save_interval=1",
                          "algorithm.entropy_coef=0.01"]),
}


def write_configs(root: Path, suffix: str, data: dict[str, str], model: str) -> dict[str, Path]:
    paths = {}
    for name, (backend, overrides) in RUNS.items():
        cfg = arithmetic_config(
            run_name=f"{name}-{suffix}", runs_root=str(root / "runs"), data=data,
            model_dir=model, ray_address="", backend=backend, overrides=overrides)
        cfg.cluster.address = None  # the local head of this ROLLFLOW_HOME
        cfg.cluster.namespace = "rf-multi"
        paths[name] = root / f"{name}-{suffix}.yaml"
        paths[name].write_text(dump_config(cfg))
    return paths


def driver(config: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "train", "--config",
                                 str(config)], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def layout(root: Path, name: str, suffix: str) -> RunLayout:
    return RunLayout.open(str(root / "runs"), f"{name}-{suffix}")


def wait_for(what: str, holds, timeout_s: float = 900) -> None:
    deadline = time.monotonic() + timeout_s
    while not holds():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def leftovers(address: str) -> tuple[list[str], list[str]]:
    """Actors and placement groups still alive on the head."""
    import ray

    ray.init(address=address, namespace="rf-multi", log_to_driver=False,
             logging_level=40)  # ERROR
    try:
        actors = [f"{a['namespace']}/{a['name']}" for a in ray.util.list_named_actors(
            all_namespaces=True)]
        groups = [pg_id for pg_id, pg in ray.util.placement_group_table().items()
                  if pg["state"] != "REMOVED"]
    finally:
        ray.shutdown()
    return actors, groups


def run_together(root: Path, suffix: str, data: dict[str, str], model: str,
                 env: dict[str, str], head: ClusterConfig, failures: list[str],
                 faults: bool = False) -> tuple[dict[str, float], dict[str, int]]:
    """Start the three runs at once (with the faults: kill one driver, then the head, then
    run the same commands again); seconds from the start to each run's end, and the first
    drivers' exit codes."""
    cfgs = write_configs(root, suffix, data, model)
    started = time.monotonic()
    procs = {name: driver(path, env, root / f"{name}-{suffix}.log") for name, path in cfgs.items()}
    if faults:
        wait_for("mock-a step 1", lambda: layout(root, "mock-a", suffix)
                 .task_record(1, "sample_prompts") is not None)
        procs["mock-a"].kill()
        print(f"killed the mock-a driver at {time.monotonic() - started:.0f} s", flush=True)
        wait_for("mock-b and lora in step 1", lambda: all(
            layout(root, name, suffix).task_record(1, "sample_prompts") is not None
            for name in ("mock-b", "lora")))
        killed = kill_processes(head_processes_of(HOME))
        print(f"killed the head ({len(killed)} processes) at "
              f"{time.monotonic() - started:.0f} s", flush=True)
    ended = wait_all(procs, started)
    first_exit = {name: p.returncode for name, p in procs.items()}
    if faults:
        cluster_address(head, start=True)  # one new head, not one per rerun racing
        procs = {name: driver(path, env, root / f"{name}-{suffix}.log")
                 for name, path in cfgs.items()}
        ended = wait_all(procs, started)
    for name, proc in procs.items():
        if proc.returncode != 0:
            failures.append(f"{name}-{suffix} failed: see {root}/{name}-{suffix}.log")
    return ended, first_exit


def wait_all(procs: dict[str, subprocess.Popen[bytes]], started: float) -> dict[str, float]:
    """Seconds from `started` to each process's end."""
    ended: dict[str, float] = {}
    while len(ended) < len(procs):
        for name, proc in procs.items():
            if name not in ended and proc.poll() is not None:
                ended[name] = time.monotonic() - started
        time.sleep(0.2)
    return ended


def check(root: Path, name: str, failures: list[str], suffixes: tuple[str, ...]) -> bool:
    """Every run `name-<suffix>` trained exactly the samples of `name-solo`."""
    want = trained_samples(layout(root, name, "solo"))
    same = bool(want)
    for suffix in suffixes:
        if trained_samples(layout(root, name, suffix)) != want:
            failures.append(f"{name}-{suffix}: samples differ from its solo run")
            same = False
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="where the runs and logs go (a temp dir)")
    args = parser.parse_args()
    root = Path(args.out or tempfile.mkdtemp(prefix="rf-multi-runs-"))
    root.mkdir(parents=True, exist_ok=True)
    from examples.arithmetic.build_model import save_tiny_model
    from examples.arithmetic.make_data import write_datasets

    model = save_tiny_model(str(root / "tiny-llama"), num_layers=2, hidden_size=64)
    data = write_datasets(str(root / "data"), n_train=200, n_test=40, n_sft=100)
    server = start_server("127.0.0.1", free_port(), str(root / "prefect-home"), wait_s=180,
                          log_path=str(root / "prefect-server.log"))
    env = {**os.environ, "PREFECT_API_URL": server.api_url, "PYTHONPATH": str(REPO),
           # a driver whose head is gone gives up on it after 10 s, not Ray's 60
           "RAY_gcs_rpc_server_reconnect_timeout_s": "10"}
    head = ClusterConfig(num_cpus=HEAD_CPUS)
    failures: list[str] = []
    try:
        cluster_address(head, start=True)
        # 1. each run alone
        solo_cfgs, solo_s = write_configs(root, "solo", data, model), {}
        for name, path in solo_cfgs.items():
            started = time.monotonic()
            proc = driver(path, env, root / f"{name}-solo.log")
            if proc.wait() != 0:
                failures.append(f"{name}: solo run failed (see {root}/{name}-solo.log)")
            solo_s[name] = time.monotonic() - started
        # 2. the three at once, undisturbed: each run's slowdown against running alone
        together_s, _ = run_together(root, "together", data, model, env, head, failures)
        # 3. the three at once again; kill mock-a's driver in its step 1, then the head once
        # mock-b and lora are in their step 1 (it takes their drivers with it); 4. the same
        # three commands again
        faulted_s, first_exit = run_together(root, "faults", data, model, env, head, failures,
                                             faults=True)
        print(f"{'run':8} {'alone':>7} {'together':>9} {'slowdown':>9} {'with faults':>12}  "
              "first exit  resumed at  samples = alone")
        for name in RUNS:
            same = check(root, name, failures, suffixes=("together", "faults"))
            resumed = json.loads(_last_json(root / f"{name}-faults.log")).get("resumed_at")
            if first_exit[name] != 0 and not resumed:
                failures.append(f"{name}-faults: the rerun did not resume (resumed_at {resumed})")
            print(f"{name:8} {solo_s[name]:6.0f}s {together_s[name]:8.0f}s "
                  f"{together_s[name] / solo_s[name]:8.2f}x {faulted_s[name]:11.0f}s  "
                  f"{first_exit[name]:>10}  {resumed!s:>10}  {'yes' if same else 'NO'}")
        actors, groups = leftovers(cluster_address(head, start=False) or "")
        print(f"left on the head: {len(actors)} named actors {actors}, "
              f"{len(groups)} placement groups")
        if actors or groups:
            failures.append("actors or placement groups outlived their runs")
    finally:
        stop_local_head()
        server.stop()
    # a worker of the killed head that outlived it would still run in the head's directory
    stray = [p.pid for p in psutil.process_iter() if _cwd(p).startswith(str(HOME))]
    print(f"processes left in the heads' directory: {stray}")
    if stray:
        failures.append(f"processes of the heads outlived them: {stray}")
    for line in failures:
        print("FAILED:", line)
    print("OK" if not failures else f"{len(failures)} checks failed", f"(runs in {root})")
    return 1 if failures else 0


def _cwd(proc: psutil.Process) -> str:
    try:
        return proc.cwd()
    except psutil.Error:
        return ""


def _last_json(log: Path) -> str:
    """The result a `rollflow train` prints last (one JSON object over several lines)."""
    text = log.read_text(errors="replace")
    start = text.rfind('\n{\n')
    return text[start + 1:text.find("\n}", start) + 2] if start >= 0 else "{}"


if __name__ == "__main__":
    sys.exit(main())
