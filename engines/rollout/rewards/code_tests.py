"""`rollout.rm_type: code_tests`: the model's program, run against the sample's tests in a
sandbox (engines/sandbox/bubblewrap.py), rewarded by the tests it passes.

The program is `metadata.code_prefix` (a signature the prompt showed, say) followed by the
code of the response: its last ```` ```python ```` block, or the whole response when it has
none. The tests are the sample's label, a JSON list of Python statements (`"assert f(2) ==
5"`), run one by one in the program's namespace. The reward is the share that pass, or 1/0
for all of them (`rollout.sandbox.reward`).

Whatever the program does, the sample gets a reward and the reason in its metadata
(`metadata.sandbox`: verdict, tests passed, total, why): an infinite loop, a fork bomb, or
100 MB of output scores what it passed before it was killed, and never stalls the step.
A label that is not a list of tests fails the step naming the sample: that is bad data,
not a bad program.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import weakref
from pathlib import Path
from typing import Any

from engines.config.sandbox import SandboxConfig
from engines.hooks.protocols import Reward, RewardFn
from engines.sandbox.bubblewrap import SandboxLimits, SandboxResult, run_sandboxed
from storage.sample import RewardError, Sample

HARNESS = (Path(__file__).resolve().parents[2] / "sandbox" / "harness.py").read_text()
PREFIX_KEY = "code_prefix"
RESULT_KEY = "sandbox"
_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def program_code(response: str) -> str:
    """The code in a response: its last fenced block (an unclosed one runs to the end), or
    the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(sample: Sample) -> list[str]:
    """The label's tests; RewardError, naming the sample, when it holds none."""
    try:
        tests = json.loads(sample.label or "")
    except json.JSONDecodeError as e:
        raise RewardError(f"{sample.describe()}: rm_type code_tests reads the label as a JSON "
                          f"list of test statements; it is not JSON ({e})") from None
    if not (isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests)):
        raise RewardError(f"{sample.describe()}: rm_type code_tests needs the label to be a "
                          f"non-empty JSON list of test statements, got {str(tests)[:100]!r}")
    return tests


def passed_tests(stdout: str, nonce: str, total: int) -> tuple[int, str]:
    """(tests passed, the first failure's reason) from the harness's result lines."""
    passed, first_failure = set(), ""
    for line in stdout.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3 or parts[0] != nonce or not parts[1].isdigit():
            continue
        index = int(parts[1])
        if index < total and parts[2] == "pass":
            passed.add(index)
        elif index < total and not first_failure:
            first_failure = f"test {index}: {parts[3] if len(parts) > 3 else 'failed'}"
    return len(passed), first_failure


def score(passed: int, total: int, all_pass: bool) -> float:
    """The reward for `passed` of `total` tests."""
    if all_pass:
        return float(passed == total)
    return passed / total


def limits_of(cfg: SandboxConfig) -> SandboxLimits:
    return SandboxLimits(
        wall_s=cfg.wall_s, cpu_s=cfg.cpu_s, memory_bytes=cfg.memory_mb * 2**20,
        max_processes=cfg.max_processes, max_output_bytes=cfg.max_output_kb * 1024,
        scratch_bytes=cfg.scratch_mb * 2**20, max_file_bytes=cfg.scratch_mb * 2**20)


def describe(result: SandboxResult, passed: int, total: int, failure: str) -> dict[str, Any]:
    """metadata.sandbox: what happened, in a form the sample's Arrow row can hold."""
    why = failure if result.verdict.value == "exited" and result.returncode == 0 else result.reason
    return {"verdict": result.verdict.value, "passed": passed, "total": total,
            "reason": why or "every test passed", "wall_s": round(result.wall_s, 3)}


def code_tests_reward(cfg: SandboxConfig | None = None) -> RewardFn:
    """The reward function; at most `cfg.max_concurrent` programs run at once in each event
    loop (the rollout actor runs one per step)."""
    cfg = cfg or SandboxConfig()
    limits = limits_of(cfg)
    slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
        weakref.WeakKeyDictionary())

    async def code_tests(args: Any, sample: Sample, /) -> Reward:
        tests = parse_tests(sample)
        program = str(sample.metadata.get(PREFIX_KEY, "")) + program_code(sample.response)
        nonce = secrets.token_hex(8)
        job = json.dumps({"program": program, "tests": tests, "nonce": nonce})
        loop = asyncio.get_running_loop()
        slot = slots.setdefault(loop, asyncio.Semaphore(cfg.max_concurrent))
        async with slot:
            result = await run_sandboxed(HARNESS, job, limits, cfg.python)
        passed, failure = passed_tests(result.stdout, nonce, len(tests))
        sample.metadata[RESULT_KEY] = describe(result, passed, len(tests), failure)
        return score(passed, len(tests), cfg.reward == "all_pass")

    return code_tests

