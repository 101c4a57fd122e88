"""The router's launcher (`engines/rollout/router_process.py`): sglang-router's own argument
parsing and Rust router, without the Python load balancer that
`python -m sglang_router.launch_router` imports (fastapi, aiohttp, uvicorn) and never uses."""

from __future__ import annotations

from pathlib import Path

from engines.rollout.router import RouterProcess
from engines.rollout.router_process import parse_router_args
from tests.unit.test_router_port import _serve


def test_the_launcher_parses_as_sglang_routers_own() -> None:
    from sglang_router.launch_router import parse_router_args as theirs

    argv = ["--host", "127.0.0.1", "--port", "31000", "--policy", "round_robin",
            "--log-level", "warn", "--prometheus-host", "127.0.0.1", "--prometheus-port", "31001",
            "--worker-urls", "http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert parse_router_args(argv) == theirs(argv)


def test_the_router_serves_without_the_python_balancers_imports() -> None:
    worker = _serve(html=False)
    url = f"http://127.0.0.1:{worker.server_address[1]}"
    router = RouterProcess([url], startup_timeout_s=30)
    try:
        router.start()
        assert [w["url"] for w in router.workers()] == [url]
        assert router._proc is not None
        # aiohttp's C parser is loaded with aiohttp, which `mini_lb` imports
        maps = Path(f"/proc/{router._proc.pid}/maps").read_text()
        assert "sglang_router_rs" in maps and "aiohttp" not in maps
    finally:
        router.shutdown()
        worker.shutdown()
