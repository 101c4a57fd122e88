"""The CLI as a separate process: the main job starts Prefect with the CLI's settings."""

from __future__ import annotations

MAIN_JOB_SETTINGS = """
import sys
import examples.arithmetic.run as job

def stop(artifacts):  # the first thing the job does after setting up: report Prefect's view
    from prefect.settings import get_current_settings

    s = get_current_settings()
    print(s.server.ephemeral.startup_timeout_seconds, s.logging.level, s.server.analytics_enabled)
    sys.exit(0)

job.prepare_artifacts = stop
sys.argv = ["run.py"]
job.main()
"""


def test_the_main_job_starts_prefect_with_the_cli_settings(tmp_path):
    """`bash scripts/main.sh` (examples/arithmetic/run.py) gets the CLI's settings, above all
    the 90 s for the ephemeral Prefect server to start (Prefect's 20 s fails on a busy
    machine), from the one function both call."""
    import os
    import subprocess
    import sys

    from flows.servers.prefect_env import PREFECT_ENV_DEFAULTS
    from tests.support import REPO_ROOT

    env = {k: v for k, v in os.environ.items() if k not in PREFECT_ENV_DEFAULTS}
    env.update(PYTHONPATH=str(REPO_ROOT), PREFECT_HOME=str(tmp_path / "prefect"))
    done = subprocess.run([sys.executable, "-c", MAIN_JOB_SETTINGS], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["90", "INFO", "False"]


def test_train_tells_its_start_at_once(tmp_path):
    """`rollflow train`'s first line (the start's lines forced, as on a terminal) comes after
    well under 2 s of CPU, however loaded the machine: what precedes it is Python's start-up
    and the CLI's imports, so an import that pulls torch or Ray in first fails here. The line's
    own clock agrees with the test's: it counts from the process's start, to the tick."""
    import os
    import re
    import subprocess
    import sys
    import time
    from pathlib import Path

    from flows.bookkeeping.start_lines import FORCE_ENV, PREFIX
    from tests.support.faults import cpu_seconds

    rollflow = Path(sys.executable).parent / "rollflow"
    started = time.monotonic()
    proc = subprocess.Popen([str(rollflow), "train", "--config", "run.yaml"], cwd=tmp_path,
                            env={**os.environ, FORCE_ENV: "1"}, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline() if proc.stderr else ""
        waited = time.monotonic() - started
        cpu = cpu_seconds(proc.pid)  # run.yaml is missing: the command goes on to say so
    finally:
        proc.kill()
        proc.wait()
    assert first.startswith(PREFIX) and "reading the config run.yaml" in first, first
    assert cpu < 2.0, f"{cpu:.2f} CPU-s before the first line"
    told = float(re.search(r"\[\s*([\d.]+) s\]", first).group(1))  # type: ignore[union-attr]
    assert told <= waited + 0.25, f"the line says {told} s, it came after {waited:.2f} s"
