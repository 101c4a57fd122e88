"""A throwaway PostgreSQL server on 127.0.0.1 (Debian's), for the orchestration benchmark and
the server test: `initdb` into a temporary directory, `pg_ctl start` on a free port, one
database `prefect`, everything removed on exit. PostgreSQL refuses to run as root, so there
its programs run as the `postgres` user."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from engines.process import free_port

PROGRAMS = ("initdb", "pg_ctl", "createdb")


def pg_program(name: str) -> str | None:
    """`name` on PATH, else in Debian's versioned directory (not on PATH there)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def postgres_installed() -> bool:
    return all(pg_program(name) for name in PROGRAMS)


def _as_postgres_user() -> list[str]:
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


@contextmanager
def local_postgres() -> Iterator[str]:
    """Yields the database's URL, `postgresql://postgres@127.0.0.1:PORT/prefect`."""
    programs = {name: pg_program(name) for name in PROGRAMS}
    missing = [name for name, path in programs.items() if path is None]
    if missing:
        raise FileNotFoundError(f"PostgreSQL is not installed ({', '.join(missing)} not found; "
                                "Debian: apt-get install postgresql)")
    root = tempfile.mkdtemp(prefix="rollflow-pg-")
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, port, run_as = os.path.join(root, "data"), free_port(), _as_postgres_user()
    subprocess.run([*run_as, str(programs["initdb"]), "-D", data, "-U", "postgres",
                    "--auth=trust", "-E", "UTF8"], check=True, capture_output=True)
    try:
        subprocess.run([*run_as, str(programs["pg_ctl"]), "-D", data, "-l",
                        os.path.join(root, "log"), "-w", "-o",
                        f"-p {port} -c listen_addresses=127.0.0.1 -k {root}", "start"],
                       check=True, capture_output=True)
        subprocess.run([*run_as, str(programs["createdb"]), "-h", "127.0.0.1", "-p", str(port),
                        "-U", "postgres", "prefect"], check=True, capture_output=True)
        yield f"postgresql://postgres@127.0.0.1:{port}/prefect"
    finally:
        subprocess.run([*run_as, str(programs["pg_ctl"]), "-D", data, "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
