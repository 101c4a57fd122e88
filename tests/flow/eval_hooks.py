"""A custom eval function (`eval.eval_function_path`) for the flow tests: it reports which
weight versions the engines hold while it runs, so a test can check that an evaluation of
version v ran on exactly v (loaded by import string in the rollout actor, like a user's)."""

from __future__ import annotations

from typing import Any

import httpx


async def engine_versions(args: Any, weight_version: int) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10.0) as client:
        versions = [(await client.get(f"{url}/weight_version")).json()["weight_version"]
                    for url in args.engine_urls]
    return {"engines_min_version": min(versions), "engines_max_version": max(versions),
            "asked_version": weight_version}
