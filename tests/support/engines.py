"""An embedded engine served for the tests that talk HTTP to one: an actor in the test
process, or `rollflow engine` as its own process (a judge model behind the OpenAI API)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from engines.inference.engine_actor import EngineActor
from engines.process import free_port
from flows.config.run import EngineConfig
from tests.support.procs import REPO_ROOT


@contextmanager
def embedded_engine(model_dir: str) -> Iterator[EngineActor]:
    """One-thread engine on `model_dir`; the process's torch thread count is restored after
    (the actor sets its own)."""
    threads = torch.get_num_threads()
    actor = EngineActor(EngineConfig(backend="embedded", model_path=model_dir), 0, num_threads=1)
    try:
        yield actor
    finally:
        actor.shutdown()
        torch.set_num_threads(threads)


MODEL = "judge"  # the name EngineCommand serves its model under


class EngineCommand:
    """`rollflow engine` serving a model on one port, stopped and started at will."""

    def __init__(self, model: Path, log: Path) -> None:
        self.model, self.log, self.port = model, log, free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flows.cli", "engine", "--model-path", str(self.model),
                 "--port", str(self.port), "--served-model-name", MODEL, "--device", "cpu"],
                env=env, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-2000:]
            try:
                if httpx.get(f"{self.base_url}/models", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the engine never answered"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None

    def kill(self) -> None:
        """Gone at once (SIGKILL): the next request is refused, none is answered on the way."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.proc = None

    def answer(self, filled: str, max_tokens: int = 16) -> str:
        """The engine's own greedy answer to a prompt, through /v1/completions."""
        body = {"model": MODEL, "prompt": filled, "max_tokens": max_tokens, "temperature": 0.0}
        reply = httpx.post(f"{self.base_url}/completions", json=body, timeout=60.0)
        reply.raise_for_status()
        return str(reply.json()["choices"][0]["text"])


@contextmanager
def engine_command(model: Path, log: Path) -> Iterator[EngineCommand]:
    """`rollflow engine` serving `model` for the block, ready before it starts."""
    engine = EngineCommand(model, log)
    engine.start()
    try:
        engine.wait_ready()
        yield engine
    finally:
        engine.stop()
