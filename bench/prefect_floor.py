"""Prefect's own floor for one rollout step: what a step costs when its work is nothing.

A parent flow (as `train`) runs one child flow run per step (as `rollout_step`, heartbeat
off as the train flow runs it), whose body is a chain of no-op tasks with the step tasks'
options (`TASK_OPTIONS`: retries, no cache) and the same `wait_for` edges. Its time per step
is what Prefect itself charges for a flow run of that shape on the server in use; what
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

from flows.rollout_step import child_flow_heartbeats_off
from tasks.step_tasks import TASK_OPTIONS

STEP_TASKS = 7  # sample_prompts, generate, filter, reward, train, broadcast_weights, commit


@task(name="no_op", **TASK_OPTIONS)
def no_op(k: int) -> int:
    return k


@flow(name="empty_step", flow_run_name="floor/rollout-{rollout_id}", persist_result=False)
def empty_step(rollout_id: int, n_tasks: int) -> int:
    """`n_tasks` no-op tasks, each waiting for the one before, as `_run_stages` chains them."""
    before: list[Any] = []
    for _ in range(n_tasks):
        before = [no_op(rollout_id, wait_for=before)]
    return rollout_id


@flow(name="empty_driver", persist_result=False)
def empty_driver(steps: int, n_tasks: int) -> list[float]:
    """Seconds per child flow run, timed around each call."""
    times = []
    for k in range(steps):
        start = time.perf_counter()
        with child_flow_heartbeats_off():
            empty_step(k, n_tasks)
        times.append(time.perf_counter() - start)
    return times


def floor_times(steps: int, n_tasks: int = STEP_TASKS) -> list[float]:
    """Per-step seconds of `steps` empty step flow runs, after one unmeasured warm-up."""
    empty_driver(1, n_tasks)
    return empty_driver(steps, n_tasks)


def main() -> None:
    from flows.server import local_prefect_api

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with local_prefect_api():
        medians = {}
        for n_tasks in (0, STEP_TASKS):
            times = floor_times(args.steps, n_tasks)
            medians[n_tasks] = statistics.median(times)
            print(summary(f"{n_tasks} tasks", times))
    per_task = (medians[STEP_TASKS] - medians[0]) / STEP_TASKS
    print(f"a flow run {1000 * medians[0]:.1f} ms, a task {1000 * per_task:.1f} ms (medians)")


if __name__ == "__main__":
    main()
