"""What the code sandbox does with each bad program, and how long it takes to stop it.

Each program below runs through `rm_type: code_tests` (engines/rollout/rewards/code_tests.py)
as a model's response would, followed by a right answer to its tests, so a reward above 0
means the bad part was not stopped. Printed per program: the verdict, the reason kept in the
sample's metadata, the reward, the seconds from start to the sandbox's end, and whether any
process of a sandbox uid outlived it. `--burners N` runs N CPU burners beside it. The
figures: bench/RESULTS.md, "Code sandbox". tests/integration/test_code_sandbox.py asserts the
same outcomes.

    python -m bench.code_sandbox [--burners 1] [--wall-s 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engines.config.sandbox import SandboxConfig
from engines.rollout.rewards.code_tests import RESULT_KEY, code_tests_reward
from storage.sample import Sample

TESTS = '["assert f(1) == 2", "assert f(5) == 10", "assert f(0) == 0"]'
RIGHT_ANSWER = "def f(x):\n    return 2 * x\n"
SYSTEM_TARGET = "/usr/rollflow-escaped"
BAD_PROGRAMS = {
    "infinite loop": "while True:\n    pass\n",
    "sleep forever": "import time\ntime.sleep(3600)\n",
    "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    "memory bomb": "blocks = []\nwhile True:\n    blocks.append(bytearray(10**8))\n",
    "write outside scratch": "open({target!r}, 'w').write('escaped')\n",
    "write to a system directory": f"open({SYSTEM_TARGET!r}, 'w').write('escaped')\n",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
    "kill the parent": "import os, signal\nos.kill({parent}, signal.SIGKILL)\n"
                       "os.kill(os.getppid(), signal.SIGKILL)\n",
    "100 MB of output": "import sys\nsys.stdout.write('x' * 100_000_000)\n",
}
"""Each: Python source, formatted with `target` (a host path outside the sandbox), `port`
(a socket listening on the host's 127.0.0.1) and `parent` (the grading process's pid)."""


def sandbox_processes() -> list[str]:
    """Processes of any sandbox uid (engines/sandbox/bubblewrap.py's range) still alive."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,comm="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if int(line.split()[0]) >= 1_000_000]


def grade(response: str, cfg: SandboxConfig, label: str = TESTS) -> tuple[float, dict[str, Any], float]:
    """(reward, metadata.sandbox, seconds) of one response."""
    sample = Sample(index=0, group_index=0, prompt="", label=label, response=response)
    started = time.monotonic()
    reward = asyncio.run(code_tests_reward(cfg)(None, sample))
    return float(reward), sample.metadata[RESULT_KEY], time.monotonic() - started


def listening() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    return server


def try_program(name: str, cfg: SandboxConfig, scratch: Path) -> dict[str, Any]:
    """Run BAD_PROGRAMS[name] and say what came of it, including what it reached outside."""
    target = scratch / f"{name.replace(' ', '-')}.txt"
    server = listening()
    try:
        program = BAD_PROGRAMS[name].format(target=str(target), port=server.getsockname()[1],
                                            parent=os.getpid())
        reward, meta, seconds = grade(program + RIGHT_ANSWER, cfg)
        try:
            server.accept()[0].close()
            connected = True
        except TimeoutError:
            connected = False
    finally:
        server.close()
    return {"reward": reward, "meta": meta, "seconds": seconds, "connected": connected,
            "wrote": target.exists() or Path(SYSTEM_TARGET).exists(),
            "left": sandbox_processes()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burners", type=int, default=0)
    parser.add_argument("--wall-s", type=float, default=4.0)
    parser.add_argument("--cpu-s", type=int, default=2)
    args = parser.parse_args()
    cfg = SandboxConfig(wall_s=args.wall_s, cpu_s=args.cpu_s)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(args.burners)]
    try:
        with tempfile.TemporaryDirectory() as scratch:
            print(f"wall_s {cfg.wall_s}, cpu_s {cfg.cpu_s}, memory {cfg.memory_mb} MB, "
                  f"{cfg.max_processes} processes, output {cfg.max_output_kb} KB; "
                  f"{args.burners} CPU burner(s) beside it")
            print("| program | verdict | reason in metadata | reward | s to end | outside reached |")
            print("|---|---|---|---|---|---|")
            for name in BAD_PROGRAMS:
                r = try_program(name, cfg, Path(scratch))
                reached = [what for what, hit in (("a connection", r["connected"]),
                           ("a file", r["wrote"]), ("processes left", r["left"])) if hit]
                print(f"| {name} | {r['meta']['verdict']} | {r['meta']['reason'][:70]} "
                      f"| {r['reward']:.2f} | {r['seconds']:.2f} | {', '.join(reached) or 'nothing'} |",
                      flush=True)
    finally:
        for b in burners:
            b.kill()


if __name__ == "__main__":
    main()
