"""One rollout engine: a generator behind its own SGLang-compatible HTTP server.

The actor is a plain class (wrapped with `ray.remote` where it is created) so tests drive it
in-process. Rollouts reach it only over HTTP (`url()`), exactly like a real SGLang server;
the actor methods are the control plane: weights arrive through Ray's object store as a
state dict (`update_weights_from_tensor`) and the engine reports the version it holds.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from engines.config.engine import EngineConfig
from engines.inference.gen_types import Generator
from engines.inference.scheduler import ContinuousScheduler
from engines.process import actor_threads, freeze_actor_heap, wait_for_health

if TYPE_CHECKING:
    import torch

# The generators, the HTTP server and torch are imported where an engine is built, not here:
# the driver imports this module for the actor class (`ray.remote`), and never runs one.

GeneratorFactory = Callable[[EngineConfig, int, int | None], Generator]
_MOCK_VOCAB, _MOCK_EOS = 256, 0
_KEEP_ALIVE_S = 60


def _embedded(config: EngineConfig, index: int, num_threads: int | None) -> Generator:
    from engines.inference.embedded_generator import EmbeddedGenerator

    if not config.model_path:
        raise ValueError("engine.model_path is required by the embedded engine")
    return EmbeddedGenerator(
        config.model_path,
        dtype=config.dtype,
        max_batch_size=config.max_batch_size,
        num_threads=num_threads,
        seed=index,
        device=config.device,
        continuous_steps=config.num_continuous_decode_steps,
        batch_invariant=bool(config.batch_invariant),
        cuda_graph=not config.disable_cuda_graph,
        torch_compile=config.enable_torch_compile,
    )


def _mock(config: EngineConfig, index: int, num_threads: int | None) -> Generator:
    """Vocab and eos from the model's config.json when there is one, else a byte vocab."""
    from engines.inference.mock_generator import MockGenerator

    path = config.model_path
    cfg_file = os.path.join(path, "config.json") if path else ""
    delay = config.mock_token_seconds
    if not os.path.exists(cfg_file):
        return MockGenerator(_MOCK_VOCAB, _MOCK_EOS, None, token_seconds=delay)
    with open(cfg_file) as f:
        cfg = json.load(f)
    eos = cfg.get("eos_token_id", _MOCK_EOS)
    return MockGenerator(int(cfg["vocab_size"]), eos[0] if isinstance(eos, list) else eos, path,
                         token_seconds=delay)


GENERATOR_BACKENDS: dict[str, GeneratorFactory] = {"embedded": _embedded, "mock": _mock}


def build_generator(config: EngineConfig, index: int, num_threads: int | None = None) -> Generator:
    factory = GENERATOR_BACKENDS.get(config.backend)
    if factory is None:
        raise ValueError(
            f"engine.backend {config.backend!r} has no in-process engine "
            f"(in-process backends: {sorted(GENERATOR_BACKENDS)}); "
            "'sglang' engines are external servers listed in engine.urls"
        )
    return factory(config, index, num_threads)


class EngineActor:
    """Generator + continuous-batching scheduler + uvicorn on a free port, in background threads."""

    def __init__(
        self,
        config: EngineConfig,
        engine_index: int = 0,
        num_threads: int | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        import uvicorn

        from engines.inference.sglang_server import create_app

        self.config = config
        self.engine_index = engine_index
        self.generator = build_generator(config, engine_index, actor_threads(num_threads))
        self.scheduler = ContinuousScheduler(self.generator, max_batch_size=config.max_batch_size)
        app = create_app(self.generator, self.scheduler)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((config.host, 0))
        self._port = self._socket.getsockname()[1]
        # uvicorn installs signal handlers only on the main thread, so a server thread
        # leaves the actor's (or pytest's) SIGINT/SIGTERM handling alone.
        uv_config = uvicorn.Config(
            app, log_level="warning", access_log=False, timeout_keep_alive=_KEEP_ALIVE_S
        )
        self._server = uvicorn.Server(uv_config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name=f"engine-{engine_index}-http",
            daemon=True,
        )
        self._thread.start()
        self._wait_healthy(startup_timeout_s)
        freeze_actor_heap()

    def _wait_healthy(self, timeout_s: float) -> None:
        wait_for_health(self.url(), self._thread.is_alive, timeout_s, poll_s=0.02,
                        what=f"engine {self.engine_index}")

    def url(self) -> str:
        return f"http://{self.config.host}:{self._port}"

    def weight_version(self) -> int:
        return self.generator.weight_version

    def pid(self) -> int:
        """The engine's process, for fault tests (kill -9, SIGSTOP) and operators."""
        return os.getpid()

    def update_weights_from_tensor(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        """Load the trainer's state dict (waits for the running batch); returns the version."""
        self.generator.update_weights(state_dict, version)
        return self.generator.weight_version

    def exports_weights(self) -> bool:
        """Whether `weights` can hand this engine's weights over (the embedded engine; not
        an SGLang server or the mock)."""
        return hasattr(self.generator, "export_weights")

    def weights(self) -> dict[str, torch.Tensor]:
        """This engine's weights on the CPU, through Ray's object store to an engine that
        replaces a lost one (`tasks.step_tasks.match_survivors`)."""
        export = getattr(self.generator, "export_weights", None)
        if export is None:
            raise NotImplementedError(f"the {self.config.backend} engine cannot export its weights")
        weights: dict[str, torch.Tensor] = export()
        return weights

    def weights_checksum(self) -> str:
        """sha256 of the engine's weights, for `check_weight_update_equal`."""
        return self.generator.weights_checksum()

    def shutdown(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10.0)
        self.scheduler.stop()
        self._socket.close()
