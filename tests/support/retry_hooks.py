"""The reward hook of the UI-retry test (tests/flow/test_ui_retry.py): a reward service that
is down from step 1 until the user brings it up (a file in the run directory)."""

from __future__ import annotations

import os
from typing import Any


class RewardServiceDown(RuntimeError):
    pass


async def reward_service(args: Any, sample: Any) -> float:
    """The share of distinct tokens in the response; from step 1 on, fails until
    `reward-service-up` exists in the run directory."""
    per_step = args.rollout.rollout_batch_size * args.rollout.n_samples_per_prompt
    up = os.path.join(args.storage.uri, args.storage.run_name, "reward-service-up")
    if sample.index >= per_step and not os.path.exists(up):
        raise RewardServiceDown("the reward service is down")
    tokens = sample.tokens[len(sample.tokens) - sample.response_length:]
    return len(set(tokens)) / max(len(tokens), 1)
