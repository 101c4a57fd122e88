"""The only way rollflow talks to an engine: SGLang's HTTP API, embedded engine or real server.

Everything goes through the same endpoints a real SGLang server (or the sglang-router in
front of several) serves, so swapping the embedded engine for SGLang changes a URL, not
code. Retries belong to the caller (the generation loop knows what is safe to repeat).

The transport is aiohttp: a GRPO step sends one request per group all at once (128 at a
time in the main job), and httpx's async client spent far more of the rollout actor's CPU
on such a burst than aiohttp (same engine, same bodies): most of the step's generation time
for short responses.
Bodies go through orjson, several times faster than the stdlib's json on a large batch
(bench/RESULTS.md, "Engine HTTP throughput").
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np
import orjson

from storage.sample import VERSION_SPANS, RoutedExperts, version_number, versions_from_spans


class SGLangError(RuntimeError):
    """A non-2xx answer, with the server's error message."""

    def __init__(self, status_code: int, message: str, path: str) -> None:
        super().__init__(f"{path} -> HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from the init arguments, so that Ray can carry it across processes.
        return type(self), (self.status_code, self.message, self.path), vars(self)


@dataclass(frozen=True, slots=True)
class GenerateOutput:
    """One response: `log_probs[i]` is the log-prob of `output_ids[i]` (empty if not asked);
    `routed_experts`: an MoE engine's routing of the whole stream (prompt included) when the
    client asked for it."""

    output_ids: list[int]
    text: str
    log_probs: list[float]
    finish_reason: dict[str, Any]
    weight_version: int
    routed_experts: RoutedExperts | None = None
    token_versions: list[int] | None = None
    """The weight version of each output token (None: all `weight_version`'s)."""

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"


def parse_output(item: dict[str, Any]) -> GenerateOutput:
    """One `/generate` answer; a null log-prob (how orjson, which the embedded engine
    answers with, writes NaN or inf) is an error naming the request and token."""
    meta = item["meta_info"]
    logprobs = meta.get("output_token_logprobs") or []
    values = [t[0] for t in logprobs]
    if None in values:
        i = values.index(None)
        raise ValueError(
            f"/generate answer for rid {meta.get('id')!r}: meta_info.output_token_logprobs[{i}] "
            f"is null, i.e. the engine's log-prob of token {logprobs[i][1]} is NaN or infinite"
        )
    output_ids = list(item.get("output_ids") or [t[1] for t in logprobs])
    version = version_number(meta.get("weight_version"))
    return GenerateOutput(
        output_ids=output_ids,
        text=item.get("text", ""),
        log_probs=[float(v) for v in values],
        finish_reason=dict(meta.get("finish_reason") or {}),
        weight_version=version,
        routed_experts=parse_routed_experts(meta),
        token_versions=versions_from_spans(meta.get(VERSION_SPANS), len(output_ids), version),
    )


def parse_routed_experts(meta: dict[str, Any]) -> RoutedExperts | None:
    """`meta_info["routed_experts"]`: base64 of little-endian int32 (SGLang's encoding)."""
    encoded = meta.get("routed_experts")
    if encoded is None:
        return None
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise ValueError(f"/generate answer for rid {meta.get('id')!r}: "
                         f"meta_info.routed_experts is not base64 ({e})") from None
    if len(raw) % 4:
        raise ValueError(f"/generate answer for rid {meta.get('id')!r}: meta_info.routed_experts "
                         f"has {len(raw)} bytes, not whole int32 ids")
    return RoutedExperts.of(np.frombuffer(raw, dtype="<i4"))


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(body)
    except ValueError:
        return text
    if isinstance(parsed, dict):
        err = parsed.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in parsed:
            return str(parsed["message"])
    return text


def generate_body(
    input_ids: Any, sampling_params: Any, rid: Any, return_logprob: bool,
    return_routed_experts: bool = False,
) -> dict[str, Any]:
    """SGLang's `/generate` body; a list of `input_ids` (and of rids) makes it a batch."""
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": sampling_params,
        "return_logprob": return_logprob,
    }
    if rid is not None:
        body["rid"] = rid
    if return_routed_experts:
        body["return_routed_experts"] = True
    return body


# What a failed call to an engine raises besides SGLangError (no answer, or a cut one).
TransportError = (aiohttp.ClientError, asyncio.TimeoutError)


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON of each `data:` event of a server-sent event stream, up to `data: [DONE]`
    (read in blocks: a row's chunk can be far longer than aiohttp's line limit)."""
    pending = b""
    async for block in content.iter_any():
        *events, pending = (pending + block).split(b"\n\n")
        for event in events:
            data = event.strip().removeprefix(b"data:").strip()
            if data == b"[DONE]":
                return
            if data:
                yield orjson.loads(data)


class SGLangClient:
    """Async client of one SGLang endpoint (a server or a router); use as a context manager.

    The aiohttp session is made on first use, in the event loop that uses it (a session is
    bound to its loop, and the rollout actor runs one loop per step).
    `return_routed_experts`: every `/generate` asks for the MoE routing (routing replay)."""

    def __init__(
        self,
        base_url: str,
        timeout: float | None = 600.0,
        max_connections: int = 256,
        keepalive_expiry_s: float = 4.0,
        return_routed_experts: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.return_routed_experts = return_routed_experts
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._max_connections = max_connections
        # Idle connections are dropped before uvicorn's 5 s keep-alive closes them from the
        # server side; reusing one the server is closing fails with a disconnect.
        self._keepalive_s = keepalive_expiry_s
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections, keepalive_timeout=self._keepalive_s,
            )
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        return self._session

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        """(status, body) of one call; transport failures raise `TransportError`s."""
        kwargs: dict[str, Any] = {} if body is None else {
            "data": orjson.dumps(body), "headers": {"Content-Type": "application/json"}}
        async with self._http().request(method, self.base_url + path, **kwargs) as response:
            return response.status, await response.read()

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        """The parsed JSON answer of a call that must succeed (SGLangError otherwise)."""
        status, raw = await self._call(method, path, body)
        if status >= 400:
            raise SGLangError(status, _error_message(raw), path)
        return orjson.loads(raw) if raw else None

    async def _answers(self, path: str) -> bool:
        try:
            status, _ = await self._call("GET", path)
        except TransportError:
            return False
        return status == 200

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateOutput:
        answer = await self._request("POST", "/generate", generate_body(
            input_ids, sampling_params, rid, return_logprob, self.return_routed_experts))
        return parse_output(answer)

    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        rids: list[str] | None = None,
        return_logprob: bool = True,
    ) -> list[GenerateOutput]:
        """One HTTP call for the whole batch (SGLang's batched `input_ids`)."""
        if not input_ids:
            return []
        answer = await self._request("POST", "/generate", generate_body(
            input_ids, sampling_params, rids, return_logprob, self.return_routed_experts))
        return [parse_output(item) for item in answer]

    async def generate_batch_stream(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        rids: list[str] | None = None,
        return_logprob: bool = True,
    ) -> AsyncIterator[tuple[int, GenerateOutput]]:
        """One streamed HTTP call for the whole batch (`stream: true`): (row, output) as each
        row ends, so a caller can take a group as soon as its rows are in. Only a row's last
        chunk is read: in SGLang's default streaming every chunk carries the whole output so
        far. A stream that ends before every row is a `TransportError`."""
        if not input_ids:
            return
        body = {**generate_body(input_ids, sampling_params, rids, return_logprob,
                                self.return_routed_experts), "stream": True}
        ended = 0
        async with self._http().post(self.base_url + "/generate", data=orjson.dumps(body),
                                     headers={"Content-Type": "application/json"}) as response:
            if response.status >= 400:
                raise SGLangError(response.status, _error_message(await response.read()),
                                  "/generate")
            async for item in _events(response.content):
                if "error" in item:
                    raise SGLangError(500, _error_message(orjson.dumps(item)), "/generate")
                if (item.get("meta_info") or {}).get("finish_reason"):
                    ended += 1
                    yield int(item.get("index", 0)), parse_output(item)
        if ended < len(input_ids):
            raise aiohttp.ClientPayloadError(
                f"{self.base_url}/generate: the stream ended after {ended} of "
                f"{len(input_ids)} rows")

    async def abort(self, rid: str) -> None:
        await self._request("POST", "/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        await self._request("POST", "/abort_request", {"rid": "", "abort_all": True})

    async def health(self) -> bool:
        return await self._answers("/health")

    async def health_generate(self) -> bool:
        return await self._answers("/health_generate")

    async def flush_cache(self) -> bool:
        """True when the server flushed (SGLang refuses while requests are running)."""
        status, _ = await self._call("POST", "/flush_cache")
        return status == 200

    async def model_info(self) -> dict[str, Any]:
        return dict(await self._request("GET", "/get_model_info"))

    async def weight_version(self) -> int:
        """The weight version the server holds (SGLang's `/get_weight_version`)."""
        answer = await self._request("GET", "/get_weight_version")
        return version_number(answer["weight_version"])

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        return dict(await self._request("POST", "/update_weights_from_disk", body))
