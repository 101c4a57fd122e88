"""Fault-injection hooks for the flow tests, plugged in through the normal extension points."""

from __future__ import annotations

import os
from typing import Any

from tasks.rm_hub import exact_match


async def reward_failing_once(args: Any, sample: Any) -> float:
    """exact_match, but the first call for sample index FAIL_INDEX raises (once per run)."""
    marker = os.path.join(args.storage.uri, args.storage.run_name, "fault-fired")
    if sample.index == int(os.environ.get("ROLLFLOW_FAIL_INDEX", "20")) and not os.path.exists(marker):
        open(marker, "w").close()
        raise ConnectionError("injected transient fault")
    return await exact_match(args, sample)
