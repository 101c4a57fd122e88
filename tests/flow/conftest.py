"""The flow tests' configs name the session's Ray head, and a moto S3 server on 127.0.0.1
serves the S3 flow tests (session-wide).

Credentials reach the Ray actors through the config (`storage.storage_options`), not through
environment variables: actors run in worker processes that were started before this fixture,
so only what travels with the config is guaranteed to arrive.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from engines.process import free_port
from tests.support.servers import S3Server


@pytest.fixture
def run_ray_address(ray_address: str) -> str:
    return ray_address


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    from moto.server import ThreadedMotoServer

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield S3Server(
            endpoint_url=f"http://127.0.0.1:{port}",
            storage_options={"key": "testing", "secret": "testing"},
        )
    finally:
        server.stop()
