"""The Prefect settings every rollflow entry point runs with (the CLI, examples/arithmetic/run.py).

Set as environment defaults before Prefect is imported, so a user's own environment wins."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

# Settings of a Prefect server rollflow starts (a driver's local one, or `rollflow server`).
SERVER_SETTINGS: dict[str, str] = {
    # The task run recorder writes task run states from events. Prefect's default writes
    # each event in its own SQLite transaction; a step's 7 tasks make ~21 of them, and the
    # next step's subflow waits for the database behind them (bench/RESULTS.md,
    # "Orchestration"). Batches of up to 100, flushed every second, keep the UI at most
    # about a second behind.
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
}

# What a Prefect server rollflow starts in its own process (`rollflow server`) gets: the
# server's settings only, not the CLI's logging ones.
SERVER_ENV_DEFAULTS: dict[str, str] = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    **SERVER_SETTINGS,
}

PREFECT_ENV_DEFAULTS: dict[str, str] = {
    # the local server is a child of this process: it reads the server's settings too
    **SERVER_ENV_DEFAULTS,
    # INFO goes to the Prefect API (the UI's Logs tab: states, retries and why), while the
    # console handler shows WARNING and up only, so a run prints its progress and result.
    "PREFECT_LOGGING_LEVEL": "INFO",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    # Prefect's own 20 s (counted in its sleeps) is too short for the ephemeral server to
    # start on a busy machine
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}


def prefect_env_defaults(
    env: MutableMapping[str, str] | None = None,
    defaults: Mapping[str, str] = PREFECT_ENV_DEFAULTS,
) -> None:
    """Put `defaults` into `env` (os.environ) where the variable is not set already."""
    target = os.environ if env is None else env
    for key, value in defaults.items():
        target.setdefault(key, value)
