"""The SGLang HTTP surface, served over any `Generator`, so clients cannot tell it from SGLang.

rollflow's client, the real sglang-router and the abort/partial-rollout path all talk HTTP
to engines; serving the same endpoints and JSON shapes from the embedded (or mock) engine
lets every one of them run for real in CI. `/generate` with `stream: true` answers SGLang's
event stream: a `data:` chunk per request as it ends (its whole output, `index` naming it in
a batch; no partial chunks), then `data: [DONE]`, so a batch's rows reach the caller one by
one. This module has the data plane (`/generate`,
`/abort_request`, health, `/flush_cache`, model info); `control_routes` the RL control plane
(pause, memory release, weight updates); `openai_routes` the OpenAI-compatible `/v1/...`.
`scheduler.ContinuousScheduler` does the batching.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engines.inference.control_routes import add_control_routes
from engines.inference.gen_types import Generator, GenRequest, GenResult, SamplingParams
from engines.inference.openai_routes import add_openai_routes
from engines.inference.scheduler import ContinuousScheduler
from engines.inference.sglang_protocol import (
    error_response,
    json_body,
    json_response,
    parse_generate,
    to_response,
)

_HEALTH_TIMEOUT_S = 20.0


def create_app(
    generator: Generator,
    scheduler: ContinuousScheduler,
    served_model_name: str | None = None,
    tool_call_parser: str | None = "hermes",
) -> FastAPI:
    """The SGLang endpoints over `generator`; the app's lifespan runs the scheduler.
    `served_model_name` (SGLang's default: the model path) is what `/v1/models` lists."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(lifespan=lifespan)

    async def run(requests: list[GenRequest]) -> list[GenResult]:
        return await asyncio.wrap_future(scheduler.submit(requests))

    def streamed(requests: list[GenRequest], logprob: list[bool], is_batch: bool,
                 start: float) -> AsyncIterator[bytes]:
        """The requests submitted now (a duplicate rid raises here, a 400); their chunks as
        each ends. A client that goes away aborts what has not ended, as SGLang does."""
        loop = asyncio.get_running_loop()
        ended: asyncio.Queue[tuple[int, GenResult]] = asyncio.Queue()

        def on_result(index: int, result: GenResult) -> None:  # (the scheduler's thread)
            loop.call_soon_threadsafe(ended.put_nowait, (index, result))

        submitted = asyncio.wrap_future(scheduler.submit(requests, on_result))

        async def events() -> AsyncIterator[bytes]:
            sent: set[int] = set()
            try:
                for _ in requests:
                    i, result = await _next_result(ended, submitted)
                    chunk = to_response(result, logprob[i], time.perf_counter() - start)
                    if is_batch:
                        chunk["index"] = i
                    sent.add(i)
                    yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            except Exception as err:  # a failed step: SGLang's error chunk
                yield b"data: " + orjson.dumps({"error": {"message": str(err)}}) + b"\n\n"
            finally:
                left = [r.rid for k, r in enumerate(requests) if k not in sent]
                if left:
                    loop.run_in_executor(None, _abort_each, scheduler, left)
            yield b"data: [DONE]\n\n"

        return events()

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        start = time.perf_counter()
        try:
            body = await json_body(request)
            requests, logprob, is_batch = parse_generate(body, generator)
            if body.get("stream"):
                return StreamingResponse(streamed(requests, logprob, is_batch, start),
                                         media_type="text/event-stream")
            results = await run(requests)
        except ValueError as err:
            return error_response(str(err))
        latency = time.perf_counter() - start
        out = [to_response(r, lp, latency) for r, lp in zip(results, logprob, strict=True)]
        return json_response(out if is_batch else out[0])

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        try:
            body = await json_body(request)
        except ValueError as err:
            return error_response(str(err))
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all", False))
        for one in rid if isinstance(rid, list) else [rid]:
            await asyncio.to_thread(scheduler.abort, str(one), abort_all)
        return Response(status_code=200)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        probe = GenRequest(
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            input_ids=[0],
            params=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        try:
            await asyncio.wait_for(run([probe]), _HEALTH_TIMEOUT_S)
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = scheduler.can_flush()
        message = "Cache flushed." if ok else "Cache not flushed: requests are running."
        return Response(content=message + "\n", status_code=200 if ok else 400)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"preferred_sampling_params": None, **generator.model_info()}

    @app.get("/weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": generator.weight_version}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        """SGLang reports the version as a string."""
        return {"weight_version": str(generator.weight_version)}

    add_control_routes(app, generator, scheduler)
    name = served_model_name or str(generator.model_info().get("model_path") or "default")
    add_openai_routes(app, generator, run, name, tool_call_parser)
    return app


async def _next_result(
    ended: asyncio.Queue[tuple[int, GenResult]], submitted: asyncio.Future[list[GenResult]]
) -> tuple[int, GenResult]:
    """The next request to end; the submission's failure if it failed first (each result is
    queued before the submission completes, so a finished one never hides a result)."""
    item = asyncio.ensure_future(ended.get())
    waited: set[asyncio.Future[Any]] = {item, submitted}
    await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
    if not item.done() and submitted.done() and submitted.exception() is not None:
        item.cancel()
        raise submitted.exception()  # type: ignore[misc]
    return await item


def _abort_each(scheduler: ContinuousScheduler, rids: list[str]) -> None:
    for rid in rids:
        scheduler.abort(rid)
