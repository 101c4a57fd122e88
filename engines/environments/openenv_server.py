"""The server of an `openenv://` environment: one already running, or one started here.

`LocalServer` runs `serve("pkg.module:Name")` in a child process: it builds the app (an OpenEnv
`Environment` subclass through `openenv.core.env_server.create_fastapi_app`, or an app made
with `create_app`, as it is), listens on a free port of 127.0.0.1, prints `READY <port>` and
serves until its stdin closes, which is when the parent stops it or dies (a kill -9 of the
rollout actor leaves no server behind). A server that died is started again on next use, so a
crash fails the episodes it was in, not the run. A child process rather than a thread: the
environment's code runs off the rollout's event loop and GIL, and a crash of it is the
server's, not the actor's.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import selectors
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import typing
from typing import IO, Any, Protocol

from engines.environments.base import EnvironmentError

log = logging.getLogger(__name__)

READY = "rollflow-openenv-ready"  # the child's first stdout line: "<READY> <port>"


class Server(Protocol):
    """Where an episode's session goes. `url` without waiting (None: not up); `start` the URL,
    starting the server if it is ours and not up (blocking); `exit_report` why a server of
    ours went, waiting a moment for a dying one (None: it is up, or not ours)."""

    def url(self) -> str | None: ...

    def start(self) -> str: ...

    def exit_report(self) -> str | None: ...

    def stop(self) -> None: ...


class RunningServer:
    """A server someone else runs: its URL, never started or stopped here."""

    def __init__(self, url: str) -> None:
        self.base_url = url

    def url(self) -> str | None:
        return self.base_url

    def start(self) -> str:
        return self.base_url

    def exit_report(self) -> str | None:
        return None

    def stop(self) -> None:
        pass


class LocalServer:
    """`serve(import_path)` in a child process on 127.0.0.1. Started on first use, again if
    it has died (a crash fails the episodes it was in, not the run), and stopped by `stop()`;
    the child exits by itself when this process dies (its stdin closes)."""

    def __init__(self, uri: str, import_path: str, sessions: int, start_timeout_s: float) -> None:
        self.uri, self.import_path = uri, import_path
        self.sessions, self.start_timeout_s = sessions, start_timeout_s
        self.starts = 0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._url: str | None = None

    def url(self) -> str | None:
        """The URL of the server if it is up (without waiting)."""
        proc = self._proc
        return self._url if proc is not None and proc.poll() is None else None

    def start(self) -> str:
        """The URL of the server, started (again) if it is not up; blocks while it starts."""
        with self._lock:
            if self.url() is not None:
                return self._url  # type: ignore[return-value]
            if self._proc is not None:
                log.warning("%s: the OpenEnv server %s; starting it again", self.uri,
                            self.exit_report())
            self._stop_locked()
            self._url = self._spawn()
            self.starts += 1
            return self._url

    def exit_report(self, wait_s: float = 2.0) -> str | None:
        proc = self._proc
        if proc is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)  # a crash closes its sockets before it has exited
        if proc.returncode is None:
            return None
        return f"its process exited with code {proc.returncode}{self._log_tail()}"

    def stop(self) -> None:
        with self._lock:
            self._stop_locked()

    def _spawn(self) -> str:
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - the server's output, kept
        path = os.pathsep.join(p for p in sys.path if p)  # the child imports what we can
        code = ("from engines.environments.openenv_server import serve; "
                f"serve({self.import_path!r}, {self.sessions})")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, env={**os.environ, "PYTHONPATH": path})
        port = self._read_port(self._proc)
        if port is None:
            exit_code = self._proc.poll()
            why = (f"exited with code {exit_code}" if exit_code is not None
                   else f"did not come up within {self.start_timeout_s:g} s")
            self._proc.kill()
            self._proc.wait()
            raise EnvironmentError(self.uri, f"the OpenEnv server of {self.import_path} {why}"
                                   f"{self._log_tail()}")
        return f"http://127.0.0.1:{port}"

    def _read_port(self, proc: subprocess.Popen[bytes]) -> int | None:
        assert proc.stdout is not None
        deadline = time.monotonic() + self.start_timeout_s
        line = b""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while b"\n" not in line and time.monotonic() < deadline:
                if sel.select(min(0.5, max(deadline - time.monotonic(), 0))):
                    chunk = os.read(proc.stdout.fileno(), 256)
                    if not chunk:
                        break  # it exited
                    line += chunk
        proc.stdout.close()
        if b"\n" not in line:  # it closed its output: wait for it to finish exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        words = line.decode(errors="replace").split()
        return int(words[1]) if len(words) >= 2 and words[0] == READY else None

    def _log_tail(self, chars: int = 1500) -> str:
        if self._log is None:
            return ""
        with contextlib.suppress(OSError):
            self._log.seek(0, os.SEEK_END)
            size = self._log.tell()
            self._log.seek(max(size - chars, 0))
            text = self._log.read().decode(errors="replace").strip()
            return f"; its output ends: {text}" if text else ""
        return ""

    def _stop_locked(self) -> None:
        proc, self._proc, self._url = self._proc, None, None
        if proc is not None:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
            with contextlib.suppress(OSError):
                proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None


def serve(import_path: str, sessions: int) -> None:
    """The started server's process: build the app, listen on a free port of 127.0.0.1,
    print `READY <port>`, serve until stdin closes (the parent's end: it stopped or died)."""
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    # os._exit throughout: a normal exit would wait on that thread's blocked read of stdin
    try:
        import socket

        import uvicorn

        app = server_app(import_path, sessions)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        print(f"{READY} {sock.getsockname()[1]}", flush=True)
        os.dup2(2, 1)  # what the environment prints must not fill a pipe nobody reads
        uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(0)


def _exit_with_parent() -> None:
    sys.stdin.buffer.read()
    os._exit(0)


def server_app(import_path: str, sessions: int) -> Any:
    """The ASGI app of `pkg.mod:Name`: an OpenEnv Environment subclass served by
    `create_fastapi_app`, or an app (`create_app(...)`) as it is."""
    module, name = import_path.split(":")
    obj = getattr(importlib.import_module(module), name)  # before openenv: a typo fails fast
    wrong = TypeError(f"{import_path} is neither an openenv Environment subclass nor an app "
                      "made by openenv.core.env_server.create_app")
    if not callable(obj):
        raise wrong
    from openenv.core.env_server import Environment, create_fastapi_app

    if isinstance(obj, type) and issubclass(obj, Environment):
        action_cls, observation_cls = environment_types(obj)
        concurrent = bool(getattr(obj, "SUPPORTS_CONCURRENT_SESSIONS", False))
        return create_fastapi_app(obj, action_cls, observation_cls,
                                  max_concurrent_envs=sessions if concurrent else 1)
    if isinstance(obj, type):
        raise wrong
    return obj


def environment_types(cls: type) -> tuple[type, type]:
    """(Action class, Observation class) of an Environment subclass: its generic arguments
    `Environment[A, O, S]`, else `step(self, action: A) -> O`."""
    from openenv.core.env_server import Action, Observation

    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            found = [a for a in typing.get_args(base) if isinstance(a, type)]
            if len(found) >= 2 and issubclass(found[0], Action) and \
                    issubclass(found[1], Observation):
                return found[0], found[1]
    with contextlib.suppress(Exception):
        hints = typing.get_type_hints(cls.step)  # type: ignore[attr-defined]
        action, observation = hints.get("action"), hints.get("return")
        if isinstance(action, type) and issubclass(action, Action) and \
                isinstance(observation, type) and issubclass(observation, Observation):
            return action, observation
    raise TypeError(f"cannot tell {cls.__name__}'s Action and Observation classes: subclass "
                    "Environment[MyAction, MyObservation, MyState], or annotate "
                    "step(self, action: MyAction) -> MyObservation")
