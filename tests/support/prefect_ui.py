"""Reading back what the Prefect UI shows, through the server's REST API (the same endpoints
the UI's pages call): flow runs by name, the task graph of a flow run, logs, artifacts."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

# The step's tasks in the order the UI must draw them (sync mode).
CHAIN = ("sample_prompts", "generate", "filter", "reward", "train", "broadcast_weights", "commit")


def step_labels(rollout_id: int, chain: tuple[str, ...] = CHAIN) -> tuple[str, ...]:
    """The task run names of one step's chain: `rollout-{id}/<task>`."""
    return tuple(f"rollout-{rollout_id}/{name}" for name in chain)


def chain_edges(rollout_id: int, chain: tuple[str, ...] = CHAIN) -> set[tuple[str, str]]:
    labels = step_labels(rollout_id, chain)
    return set(zip(labels, labels[1:], strict=False))


def step_edges(edges: set[tuple[str, str]], rollout_id: int) -> set[tuple[str, str]]:
    """The edges of a flow run's graph between tasks of step `rollout_id`."""
    prefix = f"rollout-{rollout_id}/"
    return {(a, b) for a, b in edges if a.startswith(prefix) or b.startswith(prefix)}


def post(api_url: str, path: str, body: dict[str, Any]) -> Any:
    response = httpx.post(f"{api_url}{path}", json=body, timeout=30)
    response.raise_for_status()
    return response.json()


def flow_runs(api_url: str, names: list[str]) -> dict[str, dict[str, Any]]:
    runs = post(api_url, "/flow_runs/filter", {"flow_runs": {"name": {"any_": names}}})
    return {r["name"]: r for r in runs}


FINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def settled_task_runs(api_url: str, flow_run_id: str, min_count: int = 0,
                      timeout_s: float = 60.0) -> list[Any]:
    """The flow run's task runs once the server has recorded them. Prefect 3 runs tasks in
    the client and its server writes them from their events a moment later (in batches, up
    to a flush interval late): right after a run, a busy server can still show a task run
    Pending under the name it was created with (`commit-4df`, before the task renamed itself
    `rollout-1/commit`). So read until there are `min_count` or more, every one is in a final
    state and two reads half a second apart agree, or `timeout_s` passed (then the caller's
    assertion shows what the server had)."""
    deadline, before = time.monotonic() + timeout_s, None
    while True:
        runs = post(api_url, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
        now = sorted((r["id"], r["name"], r["state_type"]) for r in runs)
        settled = (now == before and len(runs) >= min_count
                   and all(r["state_type"] in FINAL_STATES for r in runs))
        if settled or time.monotonic() > deadline:
            return runs
        before = now
        time.sleep(0.5)


def task_run_names(api_url: str, flow_run_id: str) -> list[str]:
    """The names of the flow run's task runs, sorted, once the server has them all."""
    return sorted(r["name"] for r in settled_task_runs(api_url, flow_run_id))


def graph_edges(api_url: str, flow_run_id: str) -> set[tuple[str, str]]:
    """(upstream label, downstream label) of the flow run's graph (`/graph-v2`, what the
    UI's canvas draws; its nodes are not DOM elements), once its task runs are recorded."""
    settled_task_runs(api_url, flow_run_id)
    response = httpx.get(f"{api_url}/flow_runs/{flow_run_id}/graph-v2", timeout=30)
    response.raise_for_status()
    nodes = dict((node_id, node) for node_id, node in response.json()["nodes"])
    return {(nodes[p["id"]]["label"], node["label"])
            for node in nodes.values() for p in node["parents"]}


def logs(api_url: str, flow_run_id: str) -> list[dict[str, Any]]:
    return post(api_url, "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                          "limit": 200})


def artifacts(api_url: str, flow_run_id: str) -> dict[str, dict[str, Any]]:
    """The flow run's keyed artifacts by key, the newest version of each; table data decoded."""
    found = post(api_url, "/artifacts/filter",
                 {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "CREATED_DESC"})
    out: dict[str, dict[str, Any]] = {}
    for a in reversed(found):
        if a["key"]:
            if a["type"] == "table" and isinstance(a["data"], str):
                a["data"] = json.loads(a["data"])
            out[a["key"]] = a
    return out
