"""An S3 store that fails on demand: a small HTTP proxy on 127.0.0.1 in front of moto's
server. A run's `storage.endpoint_url` names the proxy; the test then makes it answer
`503 SlowDown` (for the next N requests or for T seconds), drop connections without an
answer, or stall (answer nothing for `stall_s`, as a store that timed out), and counts what
it did, so a test can assert that its fault took effect.

    client (driver, actors) ──HTTP──> FaultyS3Proxy ──HTTP──> moto
                                      │ 503 SlowDown / dropped connection while a fault is on
"""

from __future__ import annotations

import http.client
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import urlsplit

from engines.process import free_port

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
# Sent by a proxy, never by S3 itself: which requests the proxy answered.
FAULT_HEADER = "X-Rollflow-Fault"
# The hop-by-hop headers a proxy must not pass on (RFC 9110), and the length it sets itself.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
        "proxy-connection", "content-length"}

How = Literal["slowdown", "drop", "stall"]


@dataclass
class _Fault:
    how: How
    requests: int | None  # fail this many requests more (None: no count limit)
    until: float | None   # fail until this time.monotonic() (None: no time limit)

    def take(self) -> bool:
        """Does this request fail? (and count it)"""
        if self.until is not None and time.monotonic() >= self.until:
            return False
        if self.requests is not None:
            if self.requests <= 0:
                return False
            self.requests -= 1
        return True


class FaultyS3Proxy:
    """Forwards every request to `upstream` unless a fault is on (`fail(...)`)."""

    def __init__(self, upstream: str, stall_s: float = 5.0) -> None:
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.forwarded = 0
        self.stall_s = stall_s
        self.failed: dict[str, int] = {"slowdown": 0, "drop": 0, "stall": 0}
        self._fault: _Fault | None = None
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="faulty-s3-proxy")

    # -- faults --------------------------------------------------------------------------
    def fail(self, how: How = "slowdown", requests: int | None = None,
             seconds: float | None = None) -> None:
        """From now on, fail `requests` requests, or every request for `seconds`, or (neither
        given) every request until `heal()`."""
        until = None if seconds is None else time.monotonic() + seconds
        with self._lock:
            self._fault = _Fault(how, requests, until)

    def heal(self) -> None:
        with self._lock:
            self._fault = None

    @property
    def failures(self) -> int:
        return sum(self.failed.values())

    def _take(self) -> How | None:
        with self._lock:
            if self._fault is None or not self._fault.take():
                return None
            self.failed[self._fault.how] += 1
            return self._fault.how

    # -- serving -------------------------------------------------------------------------
    def start(self) -> FaultyS3Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FaultyS3Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients use it

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                how = proxy._take()
                if how == "stall":  # the client's read timeout fires first
                    time.sleep(proxy.stall_s)
                    how = "drop"
                if how == "drop":  # no answer at all: the client sees the connection close
                    self.close_connection = True
                    self.connection.close()
                    return
                if how == "slowdown":
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN)))
                    self.send_header(FAULT_HEADER, how)
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN)
                    return
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items()
                               if k.lower() not in _HOP}
                    headers["Content-Length"] = str(len(body))
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                    self.send_response(answer.status, answer.reason)
                    for key, value in answer.getheaders():
                        if key.lower() not in _HOP:
                            self.send_header(key, value)
                    length_header = answer.getheader("Content-Length")
                    if self.command == "HEAD" and length_header is not None:
                        self.send_header("Content-Length", length_header)
                    else:
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    upstream.close()
                with proxy._lock:
                    proxy.forwarded += 1

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        return Handler
