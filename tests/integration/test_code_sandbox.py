"""`rm_type: code_tests` runs the model's programs in bubblewrap: each bad program is
contained, scores 0 with its reason in the sample's metadata, ends within its deadline, and
leaves nothing running and nothing written on the machine. Good programs score the share of
tests they pass. A CPU burner runs beside the whole module: the deadlines are wall time."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.config.sandbox import SandboxConfig
from engines.rollout.rewards import RewardHub
from engines.rollout.rewards.code_tests import RESULT_KEY, code_tests_reward
from engines.sandbox.bubblewrap import SandboxLimits, Verdict, run_sandboxed
from flows.config.run import RolloutConfig
from storage.sample import Sample
from tests.support.procs import cpu_burner

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (scripts/test.sh installs it)")

TESTS = '["assert f(1) == 2", "assert f(5) == 10", "assert f(0) == 0"]'
GOOD = "def f(x):\n    return 2 * x\n"
CFG = SandboxConfig(wall_s=4.0, cpu_s=2)


@pytest.fixture(scope="module", autouse=True)
def busy_machine() -> Iterator[None]:
    with cpu_burner():
        yield


def sandbox_processes() -> list[str]:
    """Processes of any sandbox uid (engines/sandbox/bubblewrap.py's range) still alive."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,comm="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if int(line.split()[0]) >= 1_000_000]


def grade(response: str, cfg: SandboxConfig = CFG, label: str = TESTS) -> tuple[float, dict, float]:
    sample = Sample(index=0, group_index=0, prompt="", label=label, response=response)
    started = time.monotonic()
    reward = asyncio.run(code_tests_reward(cfg)(None, sample))
    return float(reward), sample.metadata[RESULT_KEY], time.monotonic() - started


def test_a_right_program_scores_1_and_a_half_right_one_its_share() -> None:
    assert grade(GOOD)[0] == 1.0
    half = "def f(x):\n    return x + 1\n"  # right at 1 only
    reward, meta, _ = grade(half)
    assert reward == pytest.approx(1 / 3)
    assert meta["passed"] == 1 and meta["total"] == 3 and "test 1: AssertionError" in meta["reason"]
    assert grade(half, SandboxConfig(reward="all_pass"))[0] == 0.0
    fenced = f"Here it is:\n```python\n{GOOD}```\nDone."
    assert grade(fenced)[0] == 1.0


def test_tests_passed_before_a_hang_still_count() -> None:
    program = GOOD + "_calls = [0]\ndef f(x, _f=f):\n    _calls[0] += 1\n" \
        "    if _calls[0] == 3:\n        while True: pass\n    return _f(x)\n"
    reward, meta, seconds = grade(program)
    assert reward == pytest.approx(2 / 3)
    assert meta["verdict"] in (Verdict.CPU_LIMIT.value, Verdict.WALL_TIMEOUT.value)
    assert seconds < CFG.wall_s + 3


def _listening() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    return server


BAD_PROGRAMS = {
    "infinite loop": "while True:\n    pass\n",
    "sleep forever": "import time\ntime.sleep(3600)\n",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "memory bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(10**8))\n",
    "write outside scratch": "open({target!r}, 'w').write('escaped')\n",
    "write to a system directory": "open('/usr/rollflow-escaped', 'w').write('escaped')\n",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
    "kill the parent": "import os, signal\nos.kill({parent}, signal.SIGKILL)\n"
                       "os.kill(os.getppid(), signal.SIGKILL)\n",
    "100 MB of output": "import sys\nsys.stdout.write('x' * 100_000_000)\n",
}


@pytest.mark.parametrize("name", list(BAD_PROGRAMS))
def test_a_bad_program_is_contained_and_scores_0_with_its_reason(name: str, tmp_path: Path) -> None:
    target = tmp_path / "escaped.txt"
    server = _listening()
    try:
        program = BAD_PROGRAMS[name].format(target=str(target), port=server.getsockname()[1],
                                            parent=os.getpid())
        # the bad part runs first, and f is right: a reward above 0 means it was not stopped
        reward, meta, seconds = grade(program + GOOD)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert reward == 0.0, meta
    assert meta["passed"] == 0 and meta["reason"], meta
    assert seconds < CFG.wall_s + 3, f"{name} took {seconds:.1f} s against a {CFG.wall_s} s deadline"
    assert not target.exists() and not Path("/usr/rollflow-escaped").exists()
    assert not sandbox_processes(), "a process of the sandbox outlived it"
    print(f"{name}: {meta['verdict']}, {meta['reason'][:80]!r}, {seconds:.2f} s")


def test_the_sandbox_sees_no_repository_home_or_network() -> None:
    probe = ("import os, socket\n"
             "print(sorted(os.listdir('/')))\n"
             "print([i[1] for i in socket.if_nameindex()])\n")
    result = asyncio.run(run_sandboxed(probe, limits=SandboxLimits(wall_s=5)))
    assert result.verdict is Verdict.EXITED and result.returncode == 0, result.stderr
    listing = result.stdout.splitlines()
    assert "work" not in listing[0] and "home" not in listing[0]
    assert listing[1] == "['lo']"


def test_the_hub_builds_it_from_the_config() -> None:
    cfg = RolloutConfig(num_rollout=1, rollout_batch_size=1, rm_type="code_tests",
                        sandbox={"reward": "all_pass", "wall_s": 3})
    sample = Sample(index=0, group_index=0, prompt="", label=TESTS, response="def f(x):\n    return x + 1\n")
    assert asyncio.run(RewardHub.from_config(cfg).score(None, sample)) == 0.0
    assert sample.metadata[RESULT_KEY]["passed"] == 1
