"""`rm_type: code_tests` runs the model's programs in bubblewrap: each bad program is
contained, scores 0 with its reason in the sample's metadata, is ended by its deadline (not by
the test's timeout), and leaves nothing running and nothing written on the machine. Good
programs score the share of tests they pass. A CPU burner runs beside the whole module: the
deadlines are wall time.

How soon after its deadline each bad program ends is a figure, not a test: bench/code_sandbox.py,
rows in bench/RESULTS.md ("Code sandbox"). Here the bound only tells a program the deadline
ended from one nothing ended: in CI, beside two workers' flow tests, a sleep-forever program
was reaped 13 s past its 4 s deadline (`HANG_S`)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.code_sandbox import BAD_PROGRAMS, RIGHT_ANSWER, TESTS, grade, try_program
from engines.config.sandbox import SandboxConfig
from engines.rollout.rewards import RewardHub
from engines.rollout.rewards.code_tests import RESULT_KEY
from engines.sandbox.bubblewrap import SandboxLimits, Verdict, run_sandboxed
from flows.config.run import RolloutConfig
from storage.sample import Sample
from tests.support.procs import cpu_burner

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="bubblewrap is not installed (scripts/test.sh installs it)")

GOOD = RIGHT_ANSWER
CFG = SandboxConfig(wall_s=4.0, cpu_s=2)
HANG_S = CFG.wall_s + 40  # past this the deadline did not end it (the test's timeout would)


@pytest.fixture(scope="module", autouse=True)
def busy_machine() -> Iterator[None]:
    with cpu_burner():
        yield


def test_a_right_program_scores_1_and_a_half_right_one_its_share() -> None:
    assert grade(GOOD, CFG)[0] == 1.0
    half = "def f(x):\n    return x + 1\n"  # right at 1 only
    reward, meta, _ = grade(half, CFG)
    assert reward == pytest.approx(1 / 3), meta  # (what the sandbox said, if not)
    assert meta["passed"] == 1 and meta["total"] == 3 and "test 1: AssertionError" in meta["reason"]
    assert grade(half, SandboxConfig(reward="all_pass"))[0] == 0.0
    fenced = f"Here it is:\n```python\n{GOOD}```\nDone."
    assert grade(fenced, CFG)[0] == 1.0


def test_tests_passed_before_a_hang_still_count() -> None:
    program = GOOD + "_calls = [0]\ndef f(x, _f=f):\n    _calls[0] += 1\n" \
        "    if _calls[0] == 3:\n        while True: pass\n    return _f(x)\n"
    reward, meta, seconds = grade(program, CFG)
    assert reward == pytest.approx(2 / 3)
    assert meta["verdict"] in (Verdict.CPU_LIMIT.value, Verdict.WALL_TIMEOUT.value)
    assert seconds < HANG_S, meta


@pytest.mark.parametrize("name", list(BAD_PROGRAMS))
def test_a_bad_program_is_contained_and_scores_0_with_its_reason(name: str, tmp_path: Path) -> None:
    # the bad part runs first, then a right answer: a reward above 0 means it was not stopped
    got = try_program(name, CFG, tmp_path)
    assert got["reward"] == 0.0, got
    assert got["meta"]["passed"] == 0 and got["meta"]["reason"], got
    assert got["seconds"] < HANG_S, f"{name} took {got['seconds']:.1f} s, deadline {CFG.wall_s} s"
    assert not got["connected"], "the program reached a socket on the host"
    assert not got["wrote"], "the program wrote outside its scratch directory"
    assert not got["left"], f"processes of the sandbox outlived it: {got['left']}"
    print(f"{name}: {got['meta']['verdict']}, {got['meta']['reason'][:80]!r}, {got['seconds']:.2f} s")


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


def test_a_program_that_never_reads_its_input_is_killed_at_the_deadline() -> None:
    """The input is fed beside the deadline, not before it: 1 MB is more than a pipe holds."""
    started = time.monotonic()
    result = asyncio.run(run_sandboxed("import time\ntime.sleep(3600)\n", stdin="x" * 2**20,
                                       limits=SandboxLimits(wall_s=2)))
    assert result.verdict is Verdict.WALL_TIMEOUT
    assert time.monotonic() - started < 5
