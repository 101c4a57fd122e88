"""The only way rollflow talks to an engine: SGLang's HTTP API, embedded engine or real server.

Everything goes through the same endpoints a real SGLang server (or the sglang-router in
front of several) serves, so swapping the embedded engine for SGLang changes a URL, not
code. Retries belong to the caller (the generation loop knows what is safe to repeat).
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from typing import Any

import httpx


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
    """One response: `log_probs[i]` is the log-prob of `output_ids[i]` (empty if not asked)."""

    output_ids: list[int]
    text: str
    log_probs: list[float]
    finish_reason: dict[str, Any]
    weight_version: int

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"


def parse_weight_version(value: Any) -> int:
    """SGLang reports versions as strings, "default" for the weights it started with."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def parse_output(item: dict[str, Any]) -> GenerateOutput:
    meta = item["meta_info"]
    logprobs = meta.get("output_token_logprobs") or []
    return GenerateOutput(
        output_ids=list(item.get("output_ids") or [t[1] for t in logprobs]),
        text=item.get("text", ""),
        log_probs=[float(t[0]) for t in logprobs],
        finish_reason=dict(meta.get("finish_reason") or {}),
        weight_version=parse_weight_version(meta.get("weight_version")),
    )


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return response.text.strip()


def generate_body(
    input_ids: Any, sampling_params: Any, rid: Any, return_logprob: bool
) -> dict[str, Any]:
    """SGLang's `/generate` body; a list of `input_ids` (and of rids) makes it a batch."""
    body: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": sampling_params,
        "return_logprob": return_logprob,
    }
    if rid is not None:
        body["rid"] = rid
    return body


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()  # what httpx builds for each client by default


def tls_verify(url: str) -> ssl.SSLContext | bool:
    """httpx's `verify` for a client of `url`: one certificate context for every https client
    (httpx builds a new one per client by default, parsing the CA bundle: ~27 ms of CPU, and
    the generation loop and the remote reward model open clients per step and per sample);
    none at all for plain http (the engines and router rollflow starts)."""
    return _tls_context() if url.startswith("https://") else False


class SGLangClient:
    """Async client of one SGLang endpoint (a server or a router); use as a context manager."""

    def __init__(
        self,
        base_url: str,
        timeout: float | None = 600.0,
        max_connections: int = 256,
        max_keepalive_connections: int = 64,
        keepalive_expiry_s: float = 4.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # Idle connections are dropped before uvicorn's 5 s keep-alive closes them from the
        # server side; reusing one the server is closing fails with a ReadError.
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_keepalive_connections,
            keepalive_expiry=keepalive_expiry_s,
        )
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, limits=limits, verify=tls_verify(base_url)
        )

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, json: Any = None) -> httpx.Response:
        response = await self._http.request(method, path, json=json)
        if response.status_code >= 400:
            raise SGLangError(response.status_code, _error_message(response), path)
        return response

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> GenerateOutput:
        response = await self._request(
            "POST", "/generate", generate_body(input_ids, sampling_params, rid, return_logprob)
        )
        return parse_output(response.json())

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
        response = await self._request(
            "POST", "/generate", generate_body(input_ids, sampling_params, rids, return_logprob)
        )
        return [parse_output(item) for item in response.json()]

    async def abort(self, rid: str) -> None:
        await self._request("POST", "/abort_request", {"rid": rid})

    async def abort_all(self) -> None:
        await self._request("POST", "/abort_request", {"rid": "", "abort_all": True})

    async def health(self) -> bool:
        try:
            response = await self._http.get("/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def health_generate(self) -> bool:
        try:
            response = await self._http.get("/health_generate")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def flush_cache(self) -> bool:
        """True when the server flushed (SGLang refuses while requests are running)."""
        response = await self._http.post("/flush_cache")
        return response.status_code == 200

    async def model_info(self) -> dict[str, Any]:
        response = await self._request("GET", "/get_model_info")
        return dict(response.json())

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        response = await self._request("POST", "/update_weights_from_disk", body)
        return dict(response.json())
