"""Prefect's own floor for one rollout step: what a step costs when its work is nothing.

A parent flow (as `train`) runs per step a chain of no-op tasks with the step tasks' options
(`TASK_OPTIONS`: retries, no cache), untagged, with the same `wait_for` edges: in its own
flow run (the default), or in one child flow run per step (as `rollout_step` with
`logging.step_flow_runs`, heartbeat off as the train flow runs it). Its time per step is
what Prefect itself charges for that shape on the server in use; what
`bench.orchestration`'s Prefect leg adds above it is rollflow's own.

    python -m bench.prefect_floor --steps 20     # on the local server the CLI starts
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from bench.orchestration import summary  # first: importing it sets Prefect's environment up

# isort: split
from prefect import flow, task

from flows.prefect_workarounds import child_flow_heartbeats_off, untagged_tasks
from tasks.retries import TASK_OPTIONS

STEP_TASKS = 7  # sample_prompts, generate, filter, reward, train, broadcast_weights, commit


@task(name="no_op", **TASK_OPTIONS)
def no_op(k: int) -> int:
    return k


def chain(rollout_id: int, n_tasks: int) -> None:
    """`n_tasks` no-op tasks, each waiting for the one before, as `flows.rollout_step.run_step` chains them."""
    before: list[Any] = []
    with untagged_tasks():
        for _ in range(n_tasks):
            before = [no_op(rollout_id, wait_for=before)]


@flow(name="empty_step", flow_run_name="floor/rollout-{rollout_id}", persist_result=False)
def empty_step(rollout_id: int, n_tasks: int) -> int:
    chain(rollout_id, n_tasks)
    return rollout_id


@flow(name="empty_driver", persist_result=False)
def empty_driver(steps: int, n_tasks: int, step_flow_runs: bool) -> list[float]:
    """Seconds per step, timed around each."""
    times = []
    for k in range(steps):
        start = time.perf_counter()
        if step_flow_runs:
            with child_flow_heartbeats_off():
                empty_step(k, n_tasks)
        else:
            chain(k, n_tasks)
        times.append(time.perf_counter() - start)
    return times


def floor_times(steps: int, n_tasks: int = STEP_TASKS, step_flow_runs: bool = False) -> list[float]:
    """Per-step seconds of `steps` empty steps, after one unmeasured warm-up."""
    empty_driver(1, n_tasks, step_flow_runs)
    return empty_driver(steps, n_tasks, step_flow_runs)


def main() -> None:
    from flows.servers.prefect_server import local_prefect_api

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with local_prefect_api():
        medians = {}
        for label, n_tasks, child in (("7 tasks", STEP_TASKS, False),
                                      ("flow run", 0, True),
                                      ("flow run + 7 tasks", STEP_TASKS, True)):
            times = floor_times(args.steps, n_tasks, child)
            medians[label] = statistics.median(times)
            print(summary(label, times))
    print(f"a task {1000 * medians['7 tasks'] / STEP_TASKS:.1f} ms, a child flow run "
          f"{1000 * medians['flow run']:.1f} ms (medians)")


if __name__ == "__main__":
    main()
