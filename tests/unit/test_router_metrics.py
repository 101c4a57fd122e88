"""`generate_retries_in`: the router's own retries of `/generate`, read from its Prometheus
text as sgl-model-gateway (sglang-router 0.3.2) prints it; the lines are from a real router
whose worker was SIGKILLed with 32 of its requests in flight."""

from __future__ import annotations

from engines.rollout.router import generate_retries_in

METRICS = """\
# HELP smg_worker_retries_total Total retries
# TYPE smg_worker_retries_total counter
smg_router_upstream_responses_total{router_type="http",status_code="500",error_code="call_upstream_request_error"} 32
smg_worker_errors_total{worker_type="regular",connection_mode="http",error_type="backend_error"} 32
smg_worker_retries_total{worker_type="regular",endpoint="generate"} 32
smg_worker_retries_total{worker_type="regular",endpoint="chat"} 5
smg_worker_retry_backoff_seconds_count{attempt="1"} 32
"""


def test_only_the_generate_retries_are_counted() -> None:
    assert generate_retries_in(METRICS) == 32


def test_a_router_that_retried_nothing_has_no_series() -> None:
    assert generate_retries_in("# HELP smg_http_requests_total x\nsmg_http_requests_total 3\n") == 0
