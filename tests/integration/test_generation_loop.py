"""The SGLang router as the rollout runs it: a subprocess that is restarted when it dies, and
that routes a session to one engine."""

from __future__ import annotations

import asyncio

import httpx

from engines.inference.engine_actor import EngineActor
from engines.rollout.router import RouterProcess, sticky_headers
from engines.rollout.sglang_client import SGLangClient
from flows.config.run import EngineConfig


def test_router_supervision_restarts_a_dead_router(mock_engines):
    router = RouterProcess(mock_engines, policy="round_robin")
    try:
        url = router.start()
        assert sorted(w["url"] for w in router.workers()) == sorted(mock_engines)
        router._proc.kill()  # type: ignore[union-attr]
        router._proc.wait()  # type: ignore[union-attr]
        assert router.ensure_alive() is True and router.restarts == 1
        assert router.url != url or router.healthy()
        assert sorted(w["url"] for w in router.workers()) == sorted(mock_engines)
        assert router.ensure_alive() is False

        async def gen() -> list[int]:
            async with SGLangClient(router.url) as c:
                out = await c.generate([1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True})
            return out.output_ids

        assert len(asyncio.run(gen())) == 4
    finally:
        router.shutdown()
    assert not router.process_alive()


def test_manual_policy_routes_a_session_to_one_engine():
    engines = [EngineActor(EngineConfig(backend="mock"), i) for i in range(2)]
    engines[1].update_weights_from_tensor({}, 7)  # the version tells the engines apart
    router = RouterProcess([e.url() for e in engines], policy="manual")
    try:
        router.start()
        seen: dict[str, set[int]] = {}
        for session in ("a", "b", "c", "d", "e", "f"):
            for i in range(4):
                body = {"input_ids": [1, 2, i], "sampling_params": {"max_new_tokens": 2}}
                out = httpx.post(f"{router.url}/generate", json=body, timeout=10,
                                 headers=sticky_headers(session)).json()
                seen.setdefault(session, set()).add(out["meta_info"]["weight_version"])
        assert all(len(v) == 1 for v in seen.values()), seen
    finally:
        router.shutdown()
        for e in engines:
            e.shutdown()
