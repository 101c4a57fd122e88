"""The one rule for periodic work after a step (checkpoint, weight push, evaluation, curves):
every N steps, and after the run's last step. Pure arithmetic, below every other part of
`engines/`, so flows, tasks and engines all decide by the same rule (slime's
`should_run_periodic_action`).
"""

from __future__ import annotations


def every_n_steps_or_last(rollout_id: int, interval: int | None, num_rollout: int | None) -> bool:
    """Whether the periodic work runs after step `rollout_id` (counted from 0): after every
    `interval`-th step, and after the last of `num_rollout` steps (or a step past it).
    `interval` None: only after the last step; `num_rollout` None: no last step to add."""
    if num_rollout is not None and rollout_id + 1 >= num_rollout:
        return True
    return interval is not None and (rollout_id + 1) % interval == 0
