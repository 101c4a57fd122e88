"""The Prefect server rollflow starts (flows/servers/prefect_app.py) begins SQLite write
transactions IMMEDIATE: a transaction that reads, then writes after another connection wanted
to write, waits its turn instead of failing with SQLITE_BUSY_SNAPSHOT (which the server
answers with 503, and Prefect's client with a 2 s sleep)."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import sqlalchemy as sa
from prefect.server.database.configurations import AioSqliteConfiguration
from sqlalchemy.exc import OperationalError

from flows.servers.prefect_app import ImmediateWritesSqlite


async def read_then_write_while_another_writes(config: AioSqliteConfiguration) -> list[str]:
    """`first` reads, then lets `second` try to write (up to 1 s), then writes itself:
    Prefect's `create_task_run` (reads the flow run, inserts) against its task run recorder."""
    engine = await config.engine()
    try:
        async with engine.connect() as conn:
            await conn.execute(sa.text("CREATE TABLE t (who TEXT)"))
        first, second = await config.session(engine), await config.session(engine)
        first_has_read, second_wrote = asyncio.Event(), asyncio.Event()

        async def read_then_write() -> None:
            async with first, config.begin_transaction(first):
                await first.execute(sa.text("SELECT count(*) FROM t"))
                first_has_read.set()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(second_wrote.wait(), 1.0)
                await first.execute(sa.text("INSERT INTO t VALUES ('first')"))

        async def write() -> None:
            await first_has_read.wait()
            async with second, config.begin_transaction(second):
                await second.execute(sa.text("INSERT INTO t VALUES ('second')"))
            second_wrote.set()

        await asyncio.gather(read_then_write(), write())
        async with engine.connect() as conn:
            return [r[0] for r in await conn.execute(sa.text("SELECT who FROM t ORDER BY rowid"))]
    finally:
        await engine.dispose()


def test_a_write_after_a_read_waits_for_the_other_writer(tmp_path: Path) -> None:
    config = ImmediateWritesSqlite(connection_url=f"sqlite+aiosqlite:///{tmp_path}/db.sqlite")
    assert asyncio.run(read_then_write_while_another_writes(config)) == ["first", "second"]


def test_prefects_own_configuration_fails_there(tmp_path: Path) -> None:
    """The race the test above runs is real: with Prefect's DEFERRED transactions `first`
    fails. (Should Prefect change this, flows/servers/prefect_app.py can go.)"""
    config = AioSqliteConfiguration(connection_url=f"sqlite+aiosqlite:///{tmp_path}/db.sqlite")
    with pytest.raises(OperationalError, match="database is locked"):
        asyncio.run(read_then_write_while_another_writes(config))
