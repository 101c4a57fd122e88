"""Gates between the flow runs of consecutive steps in one-step off-policy (async) mode.

```
 step k-1:  ... train ─ broadcast ─ commit
                             ▲           │ (weights v_k in the engines)
 step k:    sample ─ generate ───────────┼────── filter ─ reward ─ train ─ broadcast ─ commit
                      (waits: commit k-1-s)                (waits:      (waits: generate
                                                            commit k-1)   of step k+1)
 step k+1:                   sample ─ generate  (starts once generate k is committed;
                                                 overlaps train of step k)
```
With `max_staleness: 0` the run stays on-policy: step k+1's flow run starts and draws its
prompts while step k trains, and generates once commit k has put v_{k+1} in the engines (so
step k's broadcast does not wait for that generation). What overlaps is the flow-run and
prompt bookkeeping, not compute; on a 2-core machine that makes the main job slower
(bench/RESULTS.md, "vs TRL", tried and not kept), as two live flow runs share two busy
cores and Prefect's SQLite database.

Each gate waits on what the other flow run wrote to storage (records, COMMITTED), so the flow
runs stay independent and restartable; a step that fails writes FAILED, which releases every
gate waiting on it with an error instead of a hang.

Periodic evaluation (`eval.eval_interval`) of version k+1 runs inside step k's flow run,
between broadcast and commit: the engines keep v_{k+1} until step k+1's broadcast, and step
k+1 trains only after this commit, so what is evaluated is exactly v_{k+1} (a generation
that may overlap, with max_staleness > 1, runs on the same weights, one rollout-actor call at
a time). The driver, evaluating after the step as in synchronous mode, would race the next
step's weight push and label another version's accuracy as v_{k+1}'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prefect import task
from prefect.cache_policies import NO_CACHE

from engines.config.run import RunConfig
from engines.weights.schedule import pushes_weights, required_weight_version
from storage.run_layout import RunLayout
from storage.step_signals import wait_for
from tasks.retries import step_run_name


class UpstreamStepFailed(RuntimeError):
    pass


def wait_until(
    layout: RunLayout, ready: Callable[[], bool], upstream: int, what: str,
    timeout_s: float = 3600.0,
) -> float:
    """Block until `ready()`; returns seconds waited. Fails fast if `upstream` failed. Wakes
    when this process writes a step's state (storage/step_signals.py), else every 0.5 s."""
    start = time.perf_counter()

    def settled() -> bool:
        if ready():
            return True
        if layout.failure(upstream) is not None:
            raise UpstreamStepFailed(f"step {upstream} failed; {what} will not happen")
        return False

    if not wait_for(settled, timeout_s):
        raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
    return time.perf_counter() - start


def weights_ready_step(cfg: RunConfig, rollout_id: int) -> int:
    """The step whose commit puts weights fresh enough for generating `rollout_id`."""
    return required_weight_version(cfg, rollout_id) - 1


@task(name="wait_for_weights", task_run_name=step_run_name("wait_for_weights"), cache_policy=NO_CACHE)
def wait_for_weights(layout: RunLayout, cfg: RunConfig, rollout_id: int) -> float:
    step = weights_ready_step(cfg, rollout_id)
    if step < 0:
        return 0.0
    return wait_until(layout, lambda: layout.is_committed(step), step, f"commit of step {step}")


@task(name="wait_for_previous_commit", task_run_name=step_run_name("wait_for_previous_commit"),
      cache_policy=NO_CACHE)
def wait_for_previous_commit(layout: RunLayout, rollout_id: int) -> float:
    prev = rollout_id - 1
    if prev < 0:
        return 0.0
    return wait_until(layout, lambda: layout.is_committed(prev), prev, f"commit of step {prev}")


@task(name="wait_for_next_generate", task_run_name=step_run_name("wait_for_next_generate"), cache_policy=NO_CACHE)
def wait_for_next_generate(layout: RunLayout, cfg: RunConfig, rollout_id: int) -> float:
    """Weights change only between generations (slime waits for the next rollout too).
    Not when the next generation needs this step's weights (`max_staleness: 0`): it waits
    for this commit, so waiting for it here would deadlock."""
    nxt = rollout_id + 1
    if nxt >= cfg.rollout.num_rollout or not pushes_weights(cfg, rollout_id):
        return 0.0
    if weights_ready_step(cfg, nxt) >= rollout_id:
        return 0.0
    return wait_until(
        layout, lambda: layout.task_record(nxt, "generate") is not None, nxt,
        f"generation of step {nxt}",
    )
