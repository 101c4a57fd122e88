"""SGLang's `/generate` request and response shapes, as pure functions.

Request parsing follows `GenerateReqInput` (single or batched `text` / `input_ids`,
per-request `sampling_params`, `rid`, `return_logprob`, `return_routed_experts`); responses
carry SGLang's `meta_info` (`routed_experts`: base64 of int32, as SGLang encodes them). Bad input raises ValueError naming the field, which the server turns into
SGLang's `{"error": {"message"}}` with status 400. Bodies are parsed and written with
orjson, several times faster than the stdlib's json on a large batch (bench/RESULTS.md,
"Engine HTTP throughput"), whose floats round-trip exactly, as the log-probs need.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engines.inference.gen_types import Generator, GenRequest, GenResult, SamplingParams
from engines.inference.routed_experts import encode_routed_experts
from storage.sample import VERSION_SPANS

_NEUTRAL_PARAMS: dict[str, Any] = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "min_p": 0.0,
    "n": 1,
    "spaces_between_special_tokens": True,
}


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
    routed = _as_list(body.get("return_routed_experts", False), n, "return_routed_experts")
    requests = [
        GenRequest(rid=r or uuid.uuid4().hex, input_ids=list(ids), params=p,
                   return_routed_experts=bool(e))
        for r, ids, p, e in zip(rids, prompts, params, routed, strict=True)
    ]
    return requests, logprob, is_batch


def weight_version_spans(result: GenResult) -> list[dict[str, Any]]:
    """SGLang's `meta_info.weight_versions`: the version of each run of output tokens."""
    n = len(result.output_ids)
    runs = result.version_spans or [(0, result.weight_version)]
    ends = [start for start, _ in runs[1:]] + [n]
    return [{"version": str(version), "start": start, "end": end}
            for (start, version), end in zip(runs, ends, strict=True)]


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
    if result.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(result.routed_experts)
    meta[VERSION_SPANS] = weight_version_spans(result)
    if return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tid, None]
            for lp, tid in zip(result.output_logprobs, result.output_ids, strict=True)
        ]
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


def json_response(content: Any) -> Response:
    """A JSON answer, written by orjson (which writes a non-finite float as null)."""
    return Response(orjson.dumps(content), media_type="application/json")


async def json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = orjson.loads(raw) if raw else {}
    except json.JSONDecodeError as err:
        raise ValueError(f"request body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    return body
