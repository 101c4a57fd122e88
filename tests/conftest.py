"""Session-wide real infrastructure for tests: a local Ray head, one Prefect test harness,
a tiny HF model and the arithmetic datasets. Everything runs on 127.0.0.1 and is torn down
at the end of the session."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# rollflow's own state (local-head record, Ray token, error logs) stays out of ~/.rollflow;
# short, under /tmp, because Ray's socket paths are limited in length
os.environ.setdefault("ROLLFLOW_HOME", tempfile.mkdtemp(prefix="rf-test-", dir="/tmp"))
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from examples.arithmetic.build_model import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("model") / "tiny-llama"), num_layers=2, hidden_size=64)


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from examples.arithmetic.make_data import write_datasets

    return write_datasets(str(tmp_path_factory.mktemp("data")), n_train=200, n_test=40, n_sft=100)


@pytest.fixture(scope="session")
def ray_address() -> Iterator[str]:
    """A Ray head owned by this test session (in-process start, stopped at the end)."""
    import ray

    ctx = ray.init(
        address="local",  # never join a cluster left running by `rollflow` itself
        num_cpus=4, namespace="rollflow-tests", include_dashboard=False, log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO_ROOT)}},
    )
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield str(PREFECT_API_URL.value())


# -- the fault matrix ----------------------------------------------------------------------
# Fault tests record what happened (`fault_matrix.add(...)`); the session ends with the table:
# fault -> when it was detected -> outcome -> samples identical to an uninterrupted run.
class FaultMatrix:
    COLUMNS = ("fault", "detected", "outcome", "samples identical")

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, fault: str, detected: str, outcome: str, identical: bool | None) -> None:
        same = "n/a" if identical is None else ("yes" if identical else "NO")
        self.rows.append((fault, detected, outcome, same))

    def table(self) -> str:
        lines = ["| " + " | ".join(self.COLUMNS) + " |", "|" + "---|" * len(self.COLUMNS)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


FAULTS = FaultMatrix()


@pytest.fixture(scope="session")
def fault_matrix() -> FaultMatrix:
    return FAULTS


def pytest_terminal_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if FAULTS.rows:
        terminalreporter.write_sep("=", "fault matrix")
        terminalreporter.write_line(FAULTS.table())
