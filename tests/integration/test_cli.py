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
