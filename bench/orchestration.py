"""Per-step cost of the orchestration: Prefect flow runs + Ray actors vs plain Python.

The same step (mock engine over HTTP, mock trainer, Arrow files on local disk) runs four ways:
  plain          - the stage objects in this process, called in a loop (no Prefect, no Ray)
  ray            - the same calls on the run's detached Ray actors (no Prefect)
  prefect        - the real `train` flow as it runs by default: each step a `rollout_step` flow
                   run whose tasks call the actors, timed between consecutive COMMITTED
                   markers (what the flow does between steps included)
  prefect-folded - the same with `logging.step_flow_runs: false` (the steps' tasks in the
                   train flow run)
The legs alternate in rounds (`--rounds`), so a machine that slows down mid-run slows each
leg alike. The differences are what Ray and Prefect cost per step; the table has the median
and the 90th percentile (a flat tail matters as much as the median). The Prefect legs run
against a local server per `--database`: `sqlite` (the default), `postgresql` (a throwaway
local PostgreSQL, bench/local_postgres.py) or a database URL; given twice, both servers run
side by side and the legs alternate between them. A local Ray head this starts is stopped
at the end. Usage:
  python -m bench.orchestration --steps 30 --rounds 3 --database sqlite --database postgresql
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack, nullcontext
from typing import Any

from flows.servers.prefect_env import prefect_env_defaults

prefect_env_defaults()  # the CLI's Prefect settings (logs to the API, the server's batching)
if "PREFECT_API_URL" not in os.environ and "PREFECT_HOME" not in os.environ:
    # A fresh database for the ephemeral server: figures that do not depend on history.
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="bench-prefect-")
    atexit.register(shutil.rmtree, os.environ["PREFECT_HOME"], True)


def make_config(
    root: str, run_name: str, steps: int, address: str | None, step_flow_runs: bool = False
) -> Any:
    from examples.arithmetic.build_model import save_tiny_model
    from examples.arithmetic.make_data import write_datasets
    from flows.config.loader import config_from_dict

    data = write_datasets(os.path.join(root, "data"), n_train=400, n_test=20, n_sft=10)
    model = save_tiny_model(os.path.join(root, "model"), num_layers=1, hidden_size=32)
    return config_from_dict({
        "cluster": {"address": address, "namespace": "rollflow-bench"},
        "data": {"prompt_data": data["train"]},
        "rollout": {"num_rollout": steps, "rollout_batch_size": 4, "n_samples_per_prompt": 4,
                    "max_response_len": 4, "rm_type": "exact_match"},
        "engine": {"backend": "mock", "model_path": model},
        "train": {"backend": "mock", "model_path": model},
        "storage": {"uri": os.path.join(root, "runs"), "run_name": run_name},
        "logging": {"progress": False, "plot": False, "step_flow_runs": step_flow_runs},
    })


def step_calls(rollout: Any, trainer: Any, engines: list[Any], call: Callable) -> Callable[[int], None]:
    """One rollout step as direct calls; `call(method, *args)` runs it locally or on Ray."""

    def step(k: int) -> None:
        call(rollout.sample_prompts, k)
        call(rollout.generate, k)
        kept = call(rollout.filter, k).kept_groups
        call(rollout.reward, k, kept)
        call(trainer.train, k)
        weights = call(trainer.weights)
        for e in engines:
            call(e.update_weights_from_tensor, weights, k + 1)

    return step


def time_steps(step: Callable[[int], None], n: int) -> list[float]:
    out = []
    for k in range(n):
        t = time.perf_counter()
        step(k)
        out.append(time.perf_counter() - t)
    return out


def bench_plain(cfg: Any) -> list[float]:
    from engines.inference.engine_actor import EngineActor
    from engines.rollout.rollout_manager import RolloutManager
    from engines.train.train_actor import TrainActor

    engine = EngineActor(cfg.engine, 0)
    rollout, trainer = RolloutManager(cfg), TrainActor(cfg)
    rollout.set_engines([engine.url()])
    try:
        return time_steps(step_calls(rollout, trainer, [engine], lambda m, *a: m(*a)), cfg.rollout.num_rollout)
    finally:
        engine.shutdown()


def bench_ray(cfg: Any) -> list[float]:
    import ray

    from engines.cluster.actors import get_or_create_actors, kill_run_actors
    from engines.cluster.head import connect

    connect(cfg.cluster)
    actors = get_or_create_actors(cfg)
    try:
        call = lambda m, *a: ray.get(m.remote(*a))  # noqa: E731
        return time_steps(step_calls(actors.rollout, actors.trainer, actors.engines, call),
                          cfg.rollout.num_rollout)
    finally:
        kill_run_actors(cfg)


def bench_prefect(cfg: Any) -> list[float]:
    """The real `train` flow over steps + 1 steps; a step's time is the gap between two
    consecutive COMMITTED markers, so it includes what the flow does between steps."""
    from flows.train import train
    from storage.run_layout import RunLayout, step_dir

    steps = cfg.rollout.num_rollout
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"num_rollout": steps + 1})})
    train(cfg)
    store = RunLayout.open(cfg.storage.uri, cfg.storage.run_name).store
    stamps = [os.stat(store.path(step_dir(k), "COMMITTED")).st_mtime for k in range(steps + 1)]
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


def p90(times: list[float]) -> float:
    return statistics.quantiles(times, n=10, method="inclusive")[-1]


def summary(name: str, times: list[float]) -> str:
    return (f"{name:26s} median {1000 * statistics.median(times):7.1f}   p90 {1000 * p90(times):7.1f}"
            f"   mean {1000 * statistics.mean(times):7.1f}   max {1000 * max(times):7.1f} ms/step"
            f"   (n={len(times)})")


LEGS = ("plain", "ray", "prefect", "prefect-folded")


def run_leg(leg: str, root: str, run_name: str, steps: int, address: str | None) -> list[float]:
    if leg == "plain":
        return bench_plain(make_config(root, run_name, steps, address))
    if leg == "ray":
        return bench_ray(make_config(root, run_name, steps, address))
    return bench_prefect(make_config(root, run_name, steps, address,
                                     step_flow_runs=leg == "prefect"))


def prefect_servers(stack: ExitStack, databases: list[str]) -> dict[str, str]:
    """A local Prefect server per database, all running until `stack` closes; their API
    URLs by database name."""
    from bench.local_postgres import local_postgres
    from flows.servers.prefect_server import start_local_server

    urls = {}
    for name in databases:
        url = None if name == "sqlite" else name
        if name == "postgresql":
            url = stack.enter_context(local_postgres())
        server = start_local_server(database=url)
        stack.callback(server.stop)
        server.wait_ready(120)
        urls[name] = server.api_url
    return urls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30, help="measured steps per leg, in all")
    parser.add_argument("--rounds", type=int, default=3, help="the legs alternate this often")
    parser.add_argument("--address", default=None, help="Ray address (default: local head)")
    parser.add_argument("--database", action="append", default=None,
                        help="sqlite, postgresql or a database URL; repeat to compare")
    args = parser.parse_args()
    from bench.local_head import stopping_a_new_head
    from flows.servers.prefect_server import reporting_to

    databases = args.database or ["sqlite"]
    per_round = max(2, args.steps // args.rounds)
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as root, stopping_a_new_head(args.address), \
            ExitStack() as stack:
        apis = prefect_servers(stack, databases)
        for r in range(args.rounds):
            for leg in LEGS:
                for database in (databases if leg.startswith("prefect") else [""]):
                    name = f"{leg} {database}".strip()
                    with reporting_to(apis[database]) if database else nullcontext():
                        results.setdefault(name, []).extend(run_leg(
                            leg, root, f"{leg}-{database or 'none'}-{r}", per_round,
                            args.address))
    print(f"{args.rounds} rounds of {per_round} steps per leg, alternating")
    for name, times in results.items():
        print(summary(name, times))
    plain = results["plain"]
    for name, times in results.items():
        if name != "plain":
            print(f"{name:26s} adds {1000 * (statistics.median(times) - statistics.median(plain)):7.1f} "
                  f"ms/step over the plain loop (median), {1000 * (p90(times) - p90(plain)):7.1f} (p90)")


if __name__ == "__main__":
    main()
