"""A rule whose module takes IMPORT_S to import (as reasoning_gym's does on a busy machine):
the grading pool's deadline must not pay for it."""

from __future__ import annotations

import time

IMPORT_S = 2.0
time.sleep(IMPORT_S)


def quick(response: str, label: str | None) -> float:
    return 1.0
