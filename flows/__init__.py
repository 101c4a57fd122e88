"""Prefect flows and the CLI (the top layer)."""

import engines  # noqa: F401 - fixes Ray's auth mode before anything here imports ray
