"""The SGLang HTTP subset, served over any `Generator`, so clients cannot tell it from SGLang.

rollflow's client, the real sglang-router and the abort/partial-rollout path all talk HTTP
to engines; serving the same endpoints and JSON shapes from the embedded (or mock) engine
lets every one of them run for real in CI. Request and response shapes follow SGLang's
`GenerateReqInput` and `meta_info`; bad input gets SGLang's `{"error": {"message"}}` with 400.

    HTTP handlers --submit--> queue --(burst window, <= max_batch_size)--> scheduler thread
         ^                                                                    |
         +------------------ futures resolved per request <-- generator.generate(...)
    /abort_request marks rids; the generator polls `should_abort(rid)` between decode steps.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engines.rollout.embedded_generator import Generator, GenRequest, GenResult, SamplingParams

_NEUTRAL_PARAMS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "min_p": 0.0,
    "n": 1,
    "spaces_between_special_tokens": True,
}
_HEALTH_TIMEOUT_S = 20.0


@dataclass(slots=True)
class _Pending:
    request: GenRequest
    future: Future[GenResult]


def aborted_result(request: GenRequest, weight_version: int) -> GenResult:
    """What an aborted request that never reached the generator returns (as in SGLang)."""
    reason = {"type": "abort", "message": "Abort before prefill."}
    return GenResult(request.rid, [], [], "", reason, len(request.input_ids), weight_version)


class BatchScheduler:
    """One thread that batches queued requests into `generator.generate` calls.

    A batch closes when no request arrived for `batch_wait_s`, after `max_wait_s`, or at
    `max_batch_size`: concurrent HTTP clients then share forwards instead of queueing.
    """

    def __init__(
        self,
        generator: Generator,
        max_batch_size: int = 1024,
        batch_wait_s: float = 0.005,
        max_wait_s: float = 0.05,
    ) -> None:
        self.generator = generator
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.max_wait_s = max_wait_s
        self._queue: deque[_Pending] = deque()
        self._live: set[str] = set()
        self._aborted: set[str] = set()
        self._running = 0
        self._cond = threading.Condition()
        self._stop = False
        self._last_arrival = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="batch-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def idle(self) -> bool:
        with self._cond:
            return not self._queue and self._running == 0

    def submit(self, requests: list[GenRequest]) -> list[Future[GenResult]]:
        """Queue requests; raises ValueError on a request id already in flight."""
        with self._cond:
            rids = [r.rid for r in requests]
            dup = next((r for r in rids if r in self._live), None)
            if dup is not None or len(set(rids)) != len(rids):
                raise ValueError(f"Duplicate request ID: {dup or rids}")
            pending = [_Pending(r, Future()) for r in requests]
            self._queue.extend(pending)
            self._live.update(rids)
            self._last_arrival = time.monotonic()
            self._cond.notify_all()
        return [p.future for p in pending]

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """Mark in-flight requests; unknown rids are ignored, as SGLang does."""
        with self._cond:
            if abort_all:
                self._aborted.update(self._live)
            elif rid in self._live:
                self._aborted.add(rid)

    def should_abort(self, rid: str) -> bool:
        return rid in self._aborted

    def _next_batch(self) -> list[_Pending] | None:
        with self._cond:
            while not self._queue and not self._stop:
                self._cond.wait()
            if self._stop:
                return None
            first = time.monotonic()
            while len(self._queue) < self.max_batch_size and not self._stop:
                now = time.monotonic()
                quiet_until = self._last_arrival + self.batch_wait_s
                wait = min(quiet_until, first + self.max_wait_s) - now
                if wait <= 0:
                    break
                self._cond.wait(wait)
            n = min(len(self._queue), self.max_batch_size)
            batch = [self._queue.popleft() for _ in range(n)]
            self._running += len(batch)
            return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            todo = [p for p in batch if p.request.rid not in self._aborted]
            results: dict[str, GenResult] = {}
            error: BaseException | None = None
            try:
                out = self.generator.generate([p.request for p in todo], self.should_abort)
                results = {r.rid: r for r in out}
            except Exception as err:
                error = err
            version = self.generator.weight_version
            with self._cond:
                for p in batch:
                    rid = p.request.rid
                    self._live.discard(rid)
                    self._aborted.discard(rid)
                self._running -= len(batch)
            for p in batch:
                if error is not None and p.request.rid not in results:
                    p.future.set_exception(error)
                else:
                    p.future.set_result(
                        results.get(p.request.rid) or aborted_result(p.request, version)
                    )


def error_response(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _as_list(value: Any, n: int, name: str) -> list[Any]:
    """Broadcast a per-request field of a batch request, as GenerateReqInput does."""
    if isinstance(value, list) and len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for a batch of {n}")
    return value if isinstance(value, list) else [value] * n


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    )


def _typed(d: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = d.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"sampling_params.{name} must be {kind.__name__}, got {value!r}")
    return value


def parse_sampling_params(d: Any) -> SamplingParams:
    """SGLang's sampling params dict to `SamplingParams`; errors name the field."""
    if d is None:
        return SamplingParams()
    if not isinstance(d, dict):
        raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
    known = set(SamplingParams.__dataclass_fields__)
    for key, value in d.items():
        if key not in known and value is not None and value != _NEUTRAL_PARAMS.get(key, value):
            raise ValueError(f"sampling_params.{key}={value!r} is not supported by this engine")
    stop = d.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"sampling_params.stop must be a string or list of strings: {stop!r}")
    stop_ids = d.get("stop_token_ids") or []
    if not _is_int_list(stop_ids):
        raise ValueError(f"sampling_params.stop_token_ids must be a list of ints: {stop_ids!r}")
    return SamplingParams(
        max_new_tokens=_typed(d, "max_new_tokens", int, 128),
        temperature=_typed(d, "temperature", float, 1.0),
        top_p=_typed(d, "top_p", float, 1.0),
        top_k=_typed(d, "top_k", int, -1),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_typed(d, "ignore_eos", bool, False),
        skip_special_tokens=_typed(d, "skip_special_tokens", bool, True),
        no_stop_trim=_typed(d, "no_stop_trim", bool, False),
        sampling_seed=_typed(d, "sampling_seed", int, None),
    )


def _prompts(body: dict[str, Any], generator: Generator) -> tuple[list[list[int]], bool]:
    """The batch's token ids and whether the request was a batch (list) request."""
    text: Any = body.get("text")
    input_ids: Any = body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ValueError("exactly one of text or input_ids must be given")
    if text is not None:
        if isinstance(text, str):
            return [generator.tokenize(text)], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [generator.tokenize(t) for t in text], True
        raise ValueError("text must be a string or a non-empty list of strings")
    is_batch = isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)
    prompts: list[Any] = input_ids if is_batch else [input_ids]
    vocab = generator.vocab_size
    for ids in prompts:
        if not ids or not _is_int_list(ids):
            raise ValueError("input_ids must be a non-empty list of ints or a list of such lists")
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise ValueError(f"input_ids contains {bad!r}, not a token id in [0, {vocab})")
    return prompts, is_batch


def parse_generate(
    body: dict[str, Any], generator: Generator
) -> tuple[list[GenRequest], list[bool], bool]:
    """A `/generate` body to requests, per-request return_logprob, and whether it was a batch."""
    if body.get("stream"):
        raise ValueError("stream is not supported by this engine")
    prompts, is_batch = _prompts(body, generator)
    n = len(prompts)
    params = [
        parse_sampling_params(p)
        for p in _as_list(body.get("sampling_params"), n, "sampling_params")
    ]
    rids = _as_list(body.get("rid"), n, "rid")
    if not all(r is None or isinstance(r, str) for r in rids):
        raise ValueError("rid must be a string or a list of strings")
    logprob = [bool(x) for x in _as_list(body.get("return_logprob", False), n, "return_logprob")]
    requests = [
        GenRequest(rid=r or uuid.uuid4().hex, input_ids=list(ids), params=p)
        for r, ids, p in zip(rids, prompts, params, strict=True)
    ]
    return requests, logprob, is_batch


def to_response(result: GenResult, return_logprob: bool, latency: float) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "weight_version": result.weight_version,
        "e2e_latency": latency,
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tid, None]
            for lp, tid in zip(result.output_logprobs, result.output_ids, strict=True)
        ]
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body


def create_app(generator: Generator, scheduler: BatchScheduler) -> FastAPI:
    """The SGLang endpoints over `generator`; the app's lifespan runs the scheduler."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(lifespan=lifespan)

    async def run(requests: list[GenRequest]) -> list[GenResult]:
        futures = scheduler.submit(requests)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        start = time.perf_counter()
        try:
            requests, logprob, is_batch = parse_generate(await _json_body(request), generator)
            results = await run(requests)
        except ValueError as err:
            return error_response(str(err))
        latency = time.perf_counter() - start
        out = [to_response(r, lp, latency) for r, lp in zip(results, logprob, strict=True)]
        return JSONResponse(out if is_batch else out[0])

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        try:
            body = await _json_body(request)
        except ValueError as err:
            return error_response(str(err))
        rid, abort_all = body.get("rid") or "", bool(body.get("abort_all", False))
        for one in rid if isinstance(rid, list) else [rid]:
            scheduler.abort(str(one), abort_all)
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
        ok = scheduler.idle
        message = "Cache flushed." if ok else "Cache not flushed: requests are running."
        return Response(content=message + "\n", status_code=200 if ok else 400)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {"preferred_sampling_params": None, **generator.model_info()}

    @app.get("/weight_version")
    async def weight_version() -> dict[str, Any]:
        return {"weight_version": generator.weight_version}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        try:
            body = await _json_body(request)
            model_path = body.get("model_path")
            if not isinstance(model_path, str) or not model_path:
                raise ValueError("model_path must be a non-empty string")
            version = body.get("weight_version")
            version = None if version is None else int(version)
        except ValueError as err:
            return error_response(str(err))
        if body.get("abort_all_requests"):
            scheduler.abort(abort_all=True)
        try:
            await asyncio.to_thread(generator.update_weights_from_disk, model_path, version)
        except Exception as err:
            content = {"success": False, "message": f"Failed to update weights: {err}"}
            return JSONResponse({**content, "num_paused_requests": 0}, status_code=400)
        message = f"Succeeded to update model weights (weight_version={generator.weight_version})."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    return app
