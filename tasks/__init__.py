"""Prefect tasks, thin: each calls into an actor and returns a small typed record."""

import engines  # noqa: F401 - fixes Ray's auth mode before anything here imports ray
