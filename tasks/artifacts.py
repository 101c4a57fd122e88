"""Keys of the Prefect artifacts the tasks and flows publish (progress bars, tables, curves)."""

from __future__ import annotations

import re


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")
