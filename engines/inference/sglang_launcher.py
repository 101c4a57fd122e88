"""Real SGLang engines: either external servers listed in `engine.urls`, or one
`python -m sglang.launch_server` process per engine, started and supervised by an actor.

Both speak the same HTTP protocol as the embedded engine, so the generation loop, the router
and the weight senders (`train.weight_sync: distributed | disk`) work unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping

import httpx

from engines.config.engine import EngineConfig
from engines.process import free_port, tls_verify, wait_for_health


def launch_command(
    cfg: EngineConfig, port: int, tp_size: int = 1, base_gpu_id: int | None = None
) -> list[str]:
    """The `sglang.launch_server` command line of one engine (SGLang's own flag names);
    `base_gpu_id`: the first of the engine's `tp_size` consecutive GPUs (placement). An MoE
    model's experts are split over `engine.expert_parallel` of those GPUs (`--ep-size`)."""
    if cfg.model_path is None:
        raise ValueError("engine.model_path is required to launch SGLang servers")
    # fp8: SGLang quantizes the bfloat16 checkpoint's linear layers as it loads them
    dtype = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
             "fp8": "bfloat16"}[cfg.dtype]
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", cfg.model_path,
        "--host", cfg.host,
        "--port", str(port),
        "--tp-size", str(tp_size),
        "--dtype", dtype,
        "--max-running-requests", str(cfg.max_batch_size),
        "--enable-memory-saver",  # lets colocated runs release/resume GPU memory
        "--skip-server-warmup",
        *(["--base-gpu-id", str(base_gpu_id)] if base_gpu_id is not None else []),
        *(["--ep-size", str(cfg.expert_parallel)] if cfg.expert_parallel > 1 else []),
        *(["--quantization", "fp8"] if cfg.dtype == "fp8" else []),
    ]


def server_env(base_gpu_id: int | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The server's environment. Ray narrows CUDA_VISIBLE_DEVICES to the actor's own GPU;
    a server placed by GPU id (`--base-gpu-id`, possibly spanning several) must see them all."""
    env = dict(environ)
    if base_gpu_id is not None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def wait_healthy(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    alive = (lambda: proc.poll() is None) if proc is not None else (lambda: True)
    wait_for_health(url, alive, timeout_s, poll_s=1.0, what="SGLang server")


def read_weight_version(url: str) -> int:
    response = httpx.get(f"{url}/get_weight_version", timeout=10.0, verify=tls_verify(url))
    response.raise_for_status()
    value = response.json().get("weight_version", 0)
    return int(value) if str(value).isdigit() else 0


class ExternalSGLangEngine:
    """A server someone else runs (engine.urls): rollflow only talks to it."""

    def __init__(self, url: str) -> None:
        self._url = url.rstrip("/")
        wait_healthy(self._url, None, timeout_s=60.0)

    def url(self) -> str:
        return self._url

    def weight_version(self) -> int:
        return read_weight_version(self._url)

    def update_weights_from_tensor(self, state_dict: object, version: int) -> int:
        raise RuntimeError("SGLang servers take weights over HTTP: set train.weight_sync to "
                           "'distributed' or 'disk'")


class SGLangServerActor(ExternalSGLangEngine):
    """Owns one SGLang server process (GPU machines with `sglang` installed)."""

    def __init__(
        self, cfg: EngineConfig, engine_index: int, tp_size: int = 1,
        base_gpu_id: int | None = None, startup_timeout_s: float = 900.0,
    ):
        try:
            import sglang  # noqa: F401
        except ImportError as e:
            raise RuntimeError(
                "engine.backend 'sglang' without engine.urls launches SGLang servers, but "
                "sglang is not installed here; install it or list running servers in engine.urls"
            ) from e
        self.port = free_port()
        fd, self.log_path = tempfile.mkstemp(prefix=f"sglang-{engine_index}-", suffix=".log")
        with os.fdopen(fd, "wb") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                launch_command(cfg, self.port, tp_size, base_gpu_id), stdout=log,
                stderr=subprocess.STDOUT, env=server_env(base_gpu_id, os.environ),
            )
        self._url = f"http://{cfg.host}:{self.port}"
        wait_healthy(self._url, self.proc, startup_timeout_s)

    def shutdown(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
