"""Run a program the model wrote, so that nothing it does reaches the machine or the run.

```
 rollout actor (root or a user)
   └─ bwrap  (setuid to a sandbox uid of its own, rlimits set before exec)
        └─ init (pid 1 of a new pid namespace; dies with bwrap)
             └─ python -I harness.py  < program + tests on stdin
```

What each limit is made of:
- **no network**: a network namespace of its own (`--unshare-net`): only a loopback that
  nothing listens on;
- **read-only file system**: only the directories a Python interpreter needs are mounted,
  read-only (the run's data, home directories and credentials are not there at all); the
  scratch directory, the working directory, is a tmpfs capped at `scratch_bytes`;
- **CPU time, memory, processes, file size, open files**: rlimits set before bwrap starts,
  inherited by everything inside. The process limit counts per uid, so each sandbox runs
  under a uid of its own (root is exempt from it, and its own uid would count the actor's
  processes too);
- **wall time**: past `wall_s` the whole sandbox is killed: SIGKILL to bwrap, whose init
  (`--die-with-parent`) takes the pid namespace, and with it every process inside, down;
- **output**: stdout and stderr are read up to `max_output_bytes` each; past it the sandbox
  is killed as at its deadline;
- **signals**: the program sees only its own pid namespace and runs as another uid, so it can
  neither name nor signal the actor.

`run_sandboxed` never raises for what the program does: every outcome is a `SandboxResult`
with a verdict. It raises `SandboxUnavailable` when bubblewrap is missing or cannot start on
this machine (user namespaces turned off), which a run must hear about rather than score 0s.
Outcomes per bad program and the time to kill: bench/RESULTS.md, "Code sandbox".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

_FIRST_UID = 1_000_000  # far above any real account; no passwd entry is needed
_UID_SPAN = 60_000
_next_uid = itertools.count()
_SETPRIV = "/usr/bin/setpriv"  # util-linux, in every Debian-based image


class SandboxUnavailable(RuntimeError):
    """bubblewrap is not installed, or cannot create its namespaces here."""


class Verdict(StrEnum):
    EXITED = "exited"  # the program ended on its own (returncode says how)
    WALL_TIMEOUT = "wall_timeout"  # killed at wall_s
    CPU_LIMIT = "cpu_limit"  # the kernel's RLIMIT_CPU signal
    OUTPUT_LIMIT = "output_limit"  # killed past max_output_bytes
    KILLED = "killed"  # ended by another signal (its own doing: os.kill(0), a crash)


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 * 2**20
    max_processes: int = 16
    max_output_bytes: int = 2**20
    scratch_bytes: int = 16 * 2**20
    max_file_bytes: int = 8 * 2**20
    max_open_files: int = 64


@dataclass(frozen=True, slots=True)
class SandboxResult:
    verdict: Verdict
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float

    @property
    def reason(self) -> str:
        """One line for a sample's metadata: why the program ended."""
        if self.verdict is Verdict.EXITED:
            tail = self.stderr.strip().splitlines()[-1:] if self.returncode else []
            return f"exited {self.returncode}" + (f": {tail[0][:200]}" if tail else "")
        return self.verdict.value


def base_python() -> str:
    """The interpreter behind this one: a venv's python links to it, and run by that path it
    has the standard library only, not the run's packages."""
    return os.path.realpath(sys.executable)


def _mounts(python: str) -> list[str]:
    """bwrap arguments mounting what `python` needs to run, read-only, and nothing else:
    the system's libraries and the interpreter's own prefix."""
    roots = {"/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/alternatives",
             "/etc/ld.so.cache", "/etc/localtime", str(Path(python).parent.parent)}
    parents = {str(p) for root in roots for p in Path(root).parents if str(p) != "/"}
    args: list[str] = []
    for parent in sorted(parents | {"/sandbox"}, key=lambda p: p.count("/")):
        args += ["--perms", "0755", "--dir", parent]  # (bwrap makes them 0700 otherwise)
    for root in sorted(roots):
        args += ["--ro-bind-try", root, root]
    return args


def sandbox_command(python: str, script: str, limits: SandboxLimits, uid: int | None,
                    info_fd: int | None = None) -> list[str]:
    """The bwrap command line that runs `python -I -S script` (the script mounted read-only at
    /sandbox/main.py) in fresh namespaces. `uid`: run as root, bwrap mounts with its own
    privileges and `setpriv` turns the program into that uid, with no capabilities left;
    None (not root): bwrap makes a user namespace and the program keeps the caller's uid."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not installed: `apt-get install bubblewrap` "
            "(rollout.rm_type code_tests runs the model's programs in it)")
    if uid is None:
        namespaces = ["--unshare-all"]
        become: list[str] = []
    else:
        namespaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                      "--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        become = [_SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                  "--inh-caps=-all", "--"]
    info = [] if info_fd is None else ["--info-fd", str(info_fd)]
    return [
        bwrap, *namespaces, *info, "--die-with-parent", "--new-session", "--hostname", "sandbox",
        "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/scratch",
        "--setenv", "PYTHONDONTWRITEBYTECODE", "1",
        *_mounts(python),
        "--dev", "/dev", "--proc", "/proc",
        "--perms", "01777", "--size", str(limits.scratch_bytes), "--tmpfs", "/scratch",
        "--perms", "01777", "--size", str(limits.scratch_bytes), "--tmpfs", "/tmp",
        "--ro-bind", script, "/sandbox/main.py", "--chdir", "/scratch",
        "--", *become, python, "-I", "-S", "/sandbox/main.py",  # -S: no site, 35 ms less
    ]


def _set_limits(limits: SandboxLimits, uid: int | None) -> None:
    """In the child between fork and exec. Under a uid of its own the process limit is the
    sandbox's; under the caller's it counts the caller's processes too, so it is added to
    those already running."""
    processes = limits.max_processes
    if uid is None:
        processes += _processes_of(os.getuid())
    for which, value in (
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),  # SIGXCPU, then SIGKILL
        (resource.RLIMIT_AS, (limits.memory_bytes,) * 2),
        (resource.RLIMIT_NPROC, (processes,) * 2),
        (resource.RLIMIT_FSIZE, (limits.max_file_bytes,) * 2),
        (resource.RLIMIT_NOFILE, (limits.max_open_files,) * 2),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(which, value)


def _processes_of(uid: int) -> int:
    """Tasks (threads count against RLIMIT_NPROC) that `uid` runs now."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return count


async def _read_capped(stream: asyncio.StreamReader, cap: int, over: asyncio.Event) -> bytes:
    """The first `cap` bytes of `stream`; sets `over` past them, and reads on to the end
    without keeping anything (asyncio's wait() waits for the pipes too: a reader that
    stopped would hold it after the kill)."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await stream.read(65536):
        if size <= cap:
            chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            over.set()
    return b"".join(chunks)[:cap]


async def run_sandboxed(program: str, stdin: str = "", limits: SandboxLimits | None = None,
                        python: str | None = None) -> SandboxResult:
    """Run `program` (Python source) under `limits`, with `stdin`; see the module docstring."""
    limits = limits or SandboxLimits()
    python = python or base_python()
    uid = (_FIRST_UID + (os.getpid() * 7919 + next(_next_uid)) % _UID_SPAN
           if os.geteuid() == 0 else None)
    workdir = Path(tempfile.mkdtemp(prefix="rollflow-sandbox-"))
    workdir.chmod(0o755)
    try:
        script = workdir / "main.py"
        script.write_text(program)
        script.chmod(0o644)
        info_read, info_write = os.pipe()
        with os.fdopen(info_read, "rb") as info:  # bwrap writes it once the sandbox is up
            try:
                proc = await asyncio.create_subprocess_exec(
                    *sandbox_command(python, str(script), limits, uid, info_write),
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, preexec_fn=lambda: _set_limits(limits, uid),
                    start_new_session=True, pass_fds=(info_write,))
            finally:
                os.close(info_write)
            started = time.monotonic()
            result = await _supervise(proc, stdin, limits)
            set_up = bool(info.read())
        if not set_up and result.verdict is Verdict.EXITED:
            raise SandboxUnavailable(f"bubblewrap could not start the sandbox: {result.stderr[:300]}")
        return dataclasses.replace(result, wall_s=time.monotonic() - started)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


async def _supervise(proc: asyncio.subprocess.Process, stdin: str,
                     limits: SandboxLimits) -> SandboxResult:
    """Feed `stdin`, read the output up to its cap, and kill the whole sandbox at the wall
    deadline or past the cap (the deadline runs from the start: a program that never reads
    its input cannot stall the feeding past it)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    writer = proc.stdin

    async def feed() -> None:
        try:
            writer.write(stdin.encode())
            await writer.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the program ended (or never read): what it did is in its verdict
        finally:
            writer.close()

    over = asyncio.Event()
    reads = asyncio.gather(_read_capped(proc.stdout, limits.max_output_bytes, over),
                           _read_capped(proc.stderr, limits.max_output_bytes, over))
    feeding = asyncio.ensure_future(feed())
    waiter = asyncio.ensure_future(proc.wait())
    overflow = asyncio.ensure_future(over.wait())
    done, _ = await asyncio.wait({waiter, overflow}, timeout=limits.wall_s,
                                 return_when=asyncio.FIRST_COMPLETED)
    verdict: Verdict | None = None
    if waiter not in done:
        verdict = Verdict.OUTPUT_LIMIT if overflow in done else Verdict.WALL_TIMEOUT
        _kill_whole(proc.pid)
    overflow.cancel()
    returncode = await waiter
    feeding.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await feeding
    stdout, stderr = await reads
    return SandboxResult(verdict or _exit_verdict(returncode), returncode,
                         stdout.decode(errors="replace"), stderr.decode(errors="replace"), 0.0)


def _exit_verdict(returncode: int) -> Verdict:
    """bwrap exits with its child's status, 128 + the signal for a child a signal ended."""
    if returncode == 128 + signal.SIGXCPU:
        return Verdict.CPU_LIMIT
    if returncode < 0 or returncode > 128:
        return Verdict.KILLED
    return Verdict.EXITED


def _kill_whole(pid: int) -> None:
    """SIGKILL bwrap's session; its init dies with it and takes the pid namespace down."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
