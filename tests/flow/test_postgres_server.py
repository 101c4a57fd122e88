"""`rollflow server --database postgresql://...`: the persistent server on a real PostgreSQL
(Debian's, started here on 127.0.0.1), a training reporting to it through the CLI, and its
flow runs stored in that database. Skipped where PostgreSQL is not installed."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.local_postgres import local_postgres, postgres_installed
from engines.process import free_port
from flows.config.loader import dump_config
from flows.servers.prefect_server import PrefectServer
from tests.support.configs import arithmetic_config

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    if not postgres_installed():
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    with local_postgres() as url:
        yield url


def step_flow_runs_in_database(url: str, run: str) -> list[str]:
    """Read PostgreSQL itself: the server kept its flow runs there, not in SQLite."""
    import asyncio

    import asyncpg

    async def read() -> list[str]:
        connection = await asyncpg.connect(url)
        try:
            rows = await connection.fetch(
                "SELECT name FROM flow_run WHERE name LIKE $1 ORDER BY name", f"{run}/rollout-%")
            return [row["name"] for row in rows]
        finally:
            await connection.close()

    return asyncio.run(read())


def test_a_training_reports_to_a_server_on_postgresql(
    postgres_url, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "server", "--port", str(port),
         "--home", str(tmp_path / "prefect-home"), "--database", postgres_url],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    prefect = PrefectServer(server, "127.0.0.1", port)
    api_url = prefect.api_url
    try:
        prefect.wait_ready(240)
        assert not (tmp_path / "prefect-home" / "prefect.db").exists()  # no SQLite behind it
        run = f"pg-{uuid.uuid4().hex[:6]}"
        cfg = arithmetic_config(run_name=run, runs_root=str(tmp_path / "runs"),
                                data=arithmetic_data, model_dir=tiny_model_dir,
                                ray_address=ray_address)
        path = tmp_path / "pg.yaml"
        path.write_text(dump_config(cfg))
        driver = subprocess.run(
            [sys.executable, "-m", "flows.cli", "train", "--config", str(path)],
            cwd=REPO_ROOT, env={**os.environ, "PREFECT_API_URL": api_url,
                                "PYTHONPATH": str(REPO_ROOT)},
            capture_output=True, text=True, timeout=400,
        )
        assert driver.returncode == 0, driver.stdout[-2000:] + driver.stderr[-4000:]
        runs = httpx.post(f"{api_url}/flow_runs/filter", timeout=30, json={
            "flow_runs": {"name": {"any_": [f"train-{run}", f"{run}/rollout-0",
                                            f"{run}/rollout-1"]}}}).json()
        assert {r["name"]: r["state_type"] for r in runs} == {
            f"train-{run}": "COMPLETED", f"{run}/rollout-0": "COMPLETED",
            f"{run}/rollout-1": "COMPLETED"}
        assert step_flow_runs_in_database(postgres_url, run) == [f"{run}/rollout-0",
                                                                   f"{run}/rollout-1"]
    finally:
        prefect.stop()
