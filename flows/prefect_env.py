"""The Prefect settings every rollflow entry point runs with (the CLI, examples/arithmetic/run.py).

Set as environment defaults before Prefect is imported, so a user's own environment wins."""

from __future__ import annotations

import os

PREFECT_ENV_DEFAULTS: dict[str, str] = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # INFO goes to the Prefect API (the UI's Logs tab: states, retries and why), while the
    # console handler shows WARNING and up only, so a run prints its progress and result.
    "PREFECT_LOGGING_LEVEL": "INFO",
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    # Prefect's own 20 s (counted in its sleeps) is too short for the ephemeral server to
    # start on a busy machine
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
}


def prefect_env_defaults() -> None:
    """Put `PREFECT_ENV_DEFAULTS` into os.environ where the variable is not set already."""
    for key, value in PREFECT_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
