"""A router whose port another server took before it could bind (the port is chosen free,
then bound by the child a moment later) starts again on another port, instead of failing the
step with a JSONDecodeError from the squatter's page (seen in CI: a Prefect server's UI
answers every path, `/health` and `/workers` included, with 200)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

import engines.rollout.router as router_module
from engines.process import free_port
from engines.rollout.router import RouterError, RouterProcess


class _Answers200(http.server.BaseHTTPRequestHandler):
    """200 to every GET: an HTML page (a web UI on the router's port) or JSON (a worker's
    `/health`, all the real router asks of a worker it registers)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"<!doctype html><html>a UI</html>" if self.server.html else b"{}"  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _serve(html: bool) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers200)
    server.html = html  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def squatter_and_worker() -> Iterator[tuple[int, str]]:
    squatter, worker = _serve(html=True), _serve(html=False)
    yield squatter.server_address[1], f"http://127.0.0.1:{worker.server_address[1]}"
    squatter.shutdown()
    worker.shutdown()


def test_a_router_whose_port_was_taken_starts_on_another(
        monkeypatch: pytest.MonkeyPatch, squatter_and_worker: tuple[int, str]) -> None:
    squatted_port, worker_url = squatter_and_worker
    ports = iter([squatted_port])
    monkeypatch.setattr(router_module, "free_port",
                        lambda host="127.0.0.1": next(ports, None) or free_port(host))
    router = RouterProcess([worker_url], startup_timeout_s=30)
    try:
        url = router.start()
        assert router.port != squatted_port
        assert [w["url"] for w in router.workers()] == [worker_url]
        assert url == f"http://127.0.0.1:{router.port}"
    finally:
        router.shutdown()


def test_a_server_that_is_not_the_router_is_named_as_such(
        squatter_and_worker: tuple[int, str]) -> None:
    squatted_port, worker_url = squatter_and_worker
    router = RouterProcess([worker_url])
    router.port = squatted_port
    with pytest.raises(RouterError, match=r"did not answer JSON \('<!doctype html>"):
        router.workers()
    router.shutdown()
