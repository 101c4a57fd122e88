"""The process of a Prefect server rollflow starts: Prefect's own app, with SQLite write
transactions begun IMMEDIATE.

    python -m flows.servers.prefect_app local PORT        a driver's own server (prefect_server)
    python -m flows.servers.prefect_app server start ...  `rollflow server` (Prefect's CLI)

Why: Prefect begins a write transaction DEFERRED. `POST /task_runs` (which every subflow
run, so every rollout step, makes first) reads the flow run, then inserts; when the task
run recorder commits between the two, SQLite answers SQLITE_BUSY_SNAPSHOT at once (waiting
cannot help a stale snapshot), the server answers 503 and Prefect's client sleeps 2 s before
it retries. That was about one step in ten. Begun IMMEDIATE, a write transaction takes the
write lock first and waits its turn (busy_timeout) instead (bench/RESULTS.md,
"Orchestration").
PostgreSQL needs none of this.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Any

from prefect.server.database.configurations import AioSqliteConfiguration


class ImmediateWritesSqlite(AioSqliteConfiguration):
    """Prefect's SQLite configuration with every write transaction begun IMMEDIATE (Prefect
    itself does so only for `with_for_update`). Reads outside transactions are unchanged."""

    @asynccontextmanager
    async def begin_transaction(
        self, session: Any, with_for_update: bool = False
    ) -> AsyncGenerator[Any, None]:
        async with super().begin_transaction(session, with_for_update=True) as transaction:
            yield transaction


def database_config() -> AioSqliteConfiguration | None:
    """The configuration to run the server with: ours on SQLite, Prefect's own otherwise."""
    from prefect.server.utilities.database import get_dialect
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    url = PREFECT_API_DATABASE_CONNECTION_URL.value()
    if get_dialect(url).name != "sqlite":
        return None
    return ImmediateWritesSqlite(connection_url=url)


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Stop (SIGTERM: uvicorn shuts down cleanly) once the process that started this one is
    gone, so a driver killed with -9 leaves no server behind."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def run_local(port: int) -> int:
    """What Prefect's ephemeral server runs (its app in ephemeral mode: the services a single
    driver needs, no UI), on 127.0.0.1:`port`."""
    import uvicorn
    from prefect.server.api.server import create_app

    uvicorn.run(create_app(ephemeral=True, final=True), host="127.0.0.1", port=port,
                log_level="error", lifespan="on")
    return 0


def run_prefect_cli(argv: list[str]) -> int:
    from prefect.cli import app

    sys.argv = ["prefect", *argv]  # what Prefect's CLI reads its arguments from
    try:
        app()
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def main(argv: list[str]) -> int:
    from prefect.server.database.dependencies import temporary_database_config

    exit_with_parent()
    with temporary_database_config(database_config()):
        if argv[:1] == ["local"]:
            return run_local(int(argv[1]))
        return run_prefect_cli(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
