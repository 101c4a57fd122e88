"""How long a lost engine takes to replace, without Ray's dashboard: kill -9 of one engine's
process, then `EnginePool.replace_lost` (what the step tasks call) until the pool answers
again with the survivor's weights.

The phases, each timed: the old actor killed and its name freed (`kill_group`), the run's
actors looked up again (which starts the new engine: a Ray worker, the model load, the
server's start), and the new engine given the survivor's weights (`match_survivors`; the
engines are all at version 0 here, so it has nothing to copy). Two engines on this machine's
CPU. `--no-dashboard` starts a local Ray head of its own without the dashboard (as on a
machine without `ray[default]`), stopped at the end; otherwise the run's usual head.
`--standby 1` keeps a standby engine (`engine.standby_engines`): a replacement is then the
standby taking the lost engine's place, and the new standby's start (in the background) is
timed apart, before the next round. Usage:

  python -m bench.engine_replace --backend embedded --rounds 3 --no-dashboard [--standby 1]

Figures: bench/RESULTS.md, "Engine replacement".
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from typing import Any


def make_config(root: str, backend: str, standby: int = 0) -> Any:
    from examples.arithmetic.build_model import save_tiny_model
    from examples.arithmetic.make_data import write_datasets
    from flows.config.loader import config_from_dict

    data = write_datasets(os.path.join(root, "data"), n_train=40, n_test=4, n_sft=4)
    model = save_tiny_model(os.path.join(root, "model"))
    return config_from_dict({
        "cluster": {"namespace": "rollflow-bench-replace"},
        "data": {"prompt_data": data["train"]},
        "rollout": {"num_rollout": 1, "rollout_batch_size": 4, "n_samples_per_prompt": 2,
                    "rm_type": "exact_match", "use_router": False},
        "engine": {"backend": backend, "model_path": model, "num_engines": 2,
                   "standby_engines": standby},
        "train": {"backend": "mock", "model_path": model},
        "storage": {"uri": os.path.join(root, "runs"), "run_name": "replace"},
        "logging": {"progress": False, "plot": False},
    })


def replace_once(cfg: Any, pool: Any) -> dict[str, float]:
    """Kill engine 1's process (SIGKILL), then replace it as the step tasks do; the seconds of
    each phase."""
    import ray

    from engines.cluster import actors as cluster_actors
    from engines.cluster import engine_pool

    lost_url = pool.actors.urls[1]
    pid = int(ray.get(pool.actors.engines[1].pid.remote()))
    os.kill(pid, signal.SIGKILL)
    phases: dict[str, float] = {}
    kill_group, create = cluster_actors.kill_group, cluster_actors.get_or_create_actors

    def timed(name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return call

    promote = cluster_actors._promote_standby
    cluster_actors.kill_group = timed("kill and free the name", kill_group)
    cluster_actors.get_or_create_actors = timed("start the new engine", create)
    cluster_actors._promote_standby = timed("the standby takes its place", promote)
    match = engine_pool.EnginePool.match_survivors
    engine_pool.EnginePool.match_survivors = timed("survivor's weights", match)  # type: ignore[method-assign]
    start = time.perf_counter()
    try:
        pool.replace_lost([lost_url])
        versions = pool.versions()
    finally:
        cluster_actors.kill_group, cluster_actors.get_or_create_actors = kill_group, create
        cluster_actors._promote_standby = promote
        engine_pool.EnginePool.match_survivors = match  # type: ignore[method-assign]
    phases["total"] = time.perf_counter() - start
    assert pool.actors.urls[1] != lost_url and len(set(versions)) == 1, versions
    if pool.actors.standby:  # off the clock above: the new standby, started in the background
        ray.get([e.url.remote() for e in pool.actors.standby])
        phases["(new standby ready after)"] = time.perf_counter() - start
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("embedded", "mock"), default="embedded")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-dashboard", action="store_true")
    parser.add_argument("--standby", type=int, default=0, help="engine.standby_engines")
    args = parser.parse_args()
    if args.no_dashboard:  # before rollflow reads its home: a head of our own
        os.environ["ROLLFLOW_HOME"] = tempfile.mkdtemp(prefix="bench-replace-home-")

    import ray

    from engines.cluster import head
    from engines.cluster.actors import get_or_create_actors, kill_run_actors
    from engines.cluster.engine_pool import EnginePool

    if args.no_dashboard:
        head.dashboard_available = lambda: False  # type: ignore[assignment]
    with tempfile.TemporaryDirectory(prefix="bench-replace-") as root:
        cfg = make_config(root, args.backend, args.standby)
        head.connect(cfg.cluster)
        print(f"head: {head.status(cfg.cluster).get('dashboard') or 'no dashboard'}")
        pool = EnginePool(cfg, get_or_create_actors(cfg))
        ray.get([e.url.remote() for e in pool.actors.standby])  # a standby up before round 1
        try:
            rounds = [replace_once(cfg, pool) for _ in range(args.rounds)]
        finally:
            kill_run_actors(cfg)
            if args.no_dashboard:
                head.stop_local_head()
    print(f"engine backend {args.backend}, {args.rounds} replacements of 1 of 2 engines, "
          f"{args.standby} standby")
    for name in dict.fromkeys(k for r in rounds for k in r):
        values = [r.get(name, 0.0) for r in rounds]
        print(f"  {name:24s} median {statistics.median(values):6.2f} s   "
              f"(each: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
