"""Prefect flows, the top layer: train, rollout_step, replay and evaluate, with the machinery
they run on (step_flow_runs, prefect_workarounds); the CLI, the servers, the run config and
run bookkeeping live in the subpackages cli/, servers/, config/ and bookkeeping/."""

import engines  # noqa: F401 - fixes Ray's auth mode before anything here imports ray
