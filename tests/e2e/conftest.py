"""The e2e tests' configs name the session's Ray head."""

from __future__ import annotations

import pytest


@pytest.fixture
def run_ray_address(ray_address: str) -> str:
    return ray_address
