"""`rollflow engine`: the embedded engine served on its own, as `sglang.launch_server` is,
used from another directory with a relative model path and the official `openai` client."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from engines.process import free_port
from examples.openai_agent.model import save_agent_model
from tests.support.procs import REPO_ROOT


def rollflow(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_engine_command_serves_the_openai_api(tmp_path: Path) -> None:
    save_agent_model(str(tmp_path / "tiny-agent"))
    port = free_port()
    server = rollflow("engine", "--model-path", "tiny-agent", "--port", str(port),
                      "--served-model-name", "tiny", cwd=tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)
        deadline = time.time() + 120
        while True:
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                assert server.poll() is None, server.stdout.read() if server.stdout else ""
                assert time.time() < deadline, "the engine never answered"
                time.sleep(0.2)
        assert [m.id for m in models.data] == ["tiny"]
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "what is 2+3?"}],
            max_tokens=5, temperature=0.0, logprobs=True)
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length")
        assert reply.usage is not None and reply.usage.completion_tokens == len(
            choice.logprobs.content)  # type: ignore[union-attr]
    finally:
        server.terminate()
        server.communicate(timeout=30)


@pytest.mark.parametrize("flag", ["--tp-size", "--ep-size"])
def test_engine_command_refuses_parallelism_by_name(tmp_path: Path, flag: str) -> None:
    proc = rollflow("engine", "--model-path", "m", flag, "2", cwd=tmp_path)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert f"{flag} 2: the embedded engine runs one model on one device" in out
