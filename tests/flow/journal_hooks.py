"""A slow reward for the group-journal flow test: group g of a step is scored g moments after
its response comes back, so the step's groups finish one after another and a kill lands
with some committed and some not. Every scored sample's index is appended to `scored.txt`
in the run directory, which tells the test which groups a rerun generated again."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from engines.rollout.rewards.rm_hub import exact_match

GROUPS_PER_STEP = 16
MOMENT_S = 0.15


async def slow_exact_match(args: Any, sample: Any) -> float:
    await asyncio.sleep(MOMENT_S * (sample.group_index % GROUPS_PER_STEP))
    with open(os.path.join(args.storage.uri, args.storage.run_name, "scored.txt"), "a") as f:
        f.write(f"{sample.index}\n")
    return await exact_match(args, sample)
