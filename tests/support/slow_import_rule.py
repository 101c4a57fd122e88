"""Rules whose heavy set-up takes IMPORT_S (as reasoning_gym's import does on a busy machine,
or math-verify's on first use): the grading pool's deadline must pay for neither.

- `quick`: its module takes IMPORT_S to import.
- `quick_once_prepared`: takes IMPORT_S on first use, unless the worker called the module's
  `prepare_worker()` (as engines/rollout/rewards/math_rules.py defers math-verify).
"""

from __future__ import annotations

import time

IMPORT_S = 2.0
time.sleep(IMPORT_S)
_prepared = False


def quick(response: str, label: str | None) -> float:
    return 1.0


def prepare_worker() -> None:
    global _prepared
    if not _prepared:
        time.sleep(IMPORT_S)
        _prepared = True


def quick_once_prepared(response: str, label: str | None) -> float:
    prepare_worker()
    return 1.0
