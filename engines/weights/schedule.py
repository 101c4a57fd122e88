"""When the engines get new weights, and how old a sample's weights may be (pure arithmetic).

Training step k moves the trainer to weight version k + 1. The engines receive it after step k
only on a push step: every `train.update_weights_interval` steps, the last step, and before an
evaluation. Generation of step k therefore runs on an older version, and in one-step
off-policy mode a further `rollout.max_staleness` versions behind:

```
update_weights_interval = 2, synchronous:        steps 0 1 | 2 3 | 4 5
    pushes after steps 1, 3, 5 (v2, v4, v6)      gen. by   0 0 | 2 2 | 4 4
```
The same numbers drive the gate that waits for weights (tasks/step_gates.py), the version
a restarted engine is brought to, and which buffered samples are too old to train on.
"""

from __future__ import annotations

from engines.cadence import every_n_steps_or_last
from engines.config.run import RunConfig


def required_weight_version(cfg: RunConfig, rollout_id: int) -> int:
    """Oldest policy allowed to generate step `rollout_id`: the last version pushed before
    it, less `max_staleness` in async mode (its own version when synchronous, interval 1)."""
    staleness = cfg.rollout.max_staleness if cfg.rollout.overlaps_steps else 0
    interval = cfg.train.update_weights_interval
    return max(0, rollout_id - staleness) // interval * interval


def pushes_weights(cfg: RunConfig, rollout_id: int) -> bool:
    """Whether step `rollout_id` ends by pushing its new weights to the engines."""
    interval, total = cfg.train.update_weights_interval, cfg.rollout.num_rollout
    return every_n_steps_or_last(rollout_id, interval, total) or evaluates_after(cfg, rollout_id)


def evaluates_after(cfg: RunConfig, rollout_id: int) -> bool:
    """Whether the weights step `rollout_id` trains (version rollout_id + 1) are evaluated:
    every `eval.eval_interval` steps, when the run evaluates at all."""
    # (no "or the last" here: the train flow evaluates the final weights after its loop)
    return cfg.eval.enabled and every_n_steps_or_last(rollout_id, cfg.eval.eval_interval, None)


def oldest_trainable_version(cfg: RunConfig, rollout_id: int) -> int | None:
    """Samples drawn back from the buffer (partial rollouts, surplus groups) whose first token
    came from a version older than this are regenerated from the prompt. Synchronous runs
    keep slime's unbounded partial rollouts (None)."""
    if not cfg.rollout.overlaps_steps:
        return None
    return required_weight_version(cfg, rollout_id)
