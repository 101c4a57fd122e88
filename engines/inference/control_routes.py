"""SGLang's RL control plane for the embedded engine: pause, memory, weight updates.

Request and response shapes follow SGLang's io_struct: `PauseGenerationReqInput(mode)`,
`ReleaseMemoryOccupationReqInput(tags)`, `UpdateWeightsFromTensorReqInput`
(`serialized_named_tensors`: one entry per TP rank, here rank 0's is read -- in slime's
colocated layout the one from the train rank on this engine's GPU; SGLang's
`MultiprocessingSerializer` payload of CUDA IPC handles, plain or `load_format:
"flattened_bucket"`, through an allow-list unpickler -- `engines.weights.cuda_ipc` -- or, for
CPU weights, base64 of `torch.save(list[(name, tensor)])` -- `engines.weights.sync`),
`UpdateWeightFromDiskReqInput`,
`InitWeightsUpdateGroupReqInput`, `UpdateWeightsFromDistributedReqInput(names, dtypes, shapes)`,
`CheckWeightsReqInput(action="checksum")`. Weight updates answer `{"success", "message"}`
(400 on failure); weight versions are strings in SGLang and ints in rollflow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from engines.inference.gen_types import MEMORY_TAGS, Generator
from engines.inference.scheduler import ContinuousScheduler
from engines.inference.sglang_protocol import error_response, json_body

if TYPE_CHECKING:  # torch is imported by the first weight update that carries tensors: the
    # mock engine gets none and never pays its import (engines/train/mock_backend.py)
    from engines.weights.sync import WeightUpdateGroup

Handler = Callable[[dict[str, Any]], Awaitable[str]]


def _version(body: dict[str, Any], key: str = "weight_version") -> int | None:
    value = body.get(key)
    if value is None:
        return None
    try:
        return int(value)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{key} must be an integer (as int or string), got {value!r}") from err


def _tags(body: dict[str, Any]) -> list[str]:
    tags = body.get("tags") or list(MEMORY_TAGS)
    bad = [t for t in tags if t not in MEMORY_TAGS] if isinstance(tags, list) else tags
    if bad:
        raise ValueError(f"tags must be a list of {list(MEMORY_TAGS)}, got {tags!r}")
    return list(tags)


def _str_list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list):
        raise ValueError(f"{key} must be a list, got {type(value).__name__}")
    return value


def add_control_routes(app: FastAPI, generator: Generator, scheduler: ContinuousScheduler) -> None:
    groups: dict[str, WeightUpdateGroup] = {}

    def weight_route(path: str, work: Handler) -> None:
        """POST `path`: bad input is 400 with SGLang's error shape (naming the field),
        failed updates 400 with `{"success": false}`; `abort_all_requests` aborts first as in SGLang."""

        @app.post(path, name=path.strip("/"))
        async def route(request: Request) -> Response:
            try:
                body = await json_body(request)
            except ValueError as err:
                return error_response(str(err))
            if body.get("abort_all_requests"):
                await asyncio.to_thread(scheduler.abort, "", True)
            try:
                message = await work(body)
            except (ValueError, KeyError) as err:
                return error_response(f"{path.strip('/')}: {err}")
            except Exception as err:
                content = {"success": False, "message": f"{path.strip('/')} failed: {err}"}
                return JSONResponse(content, status_code=400)
            return JSONResponse({"success": True, "message": message})

    def load_tensor_entry(entry: str, load_format: str | None, version: int | None) -> int:
        """Decode and copy in the scheduler's gap; CUDA IPC tensors alias the trainer's
        memory, so the copy is finished before the handles are let go."""
        import torch

        from engines.weights.cuda_ipc import named_tensors_from_entry

        named = named_tensors_from_entry(entry, load_format)
        scheduler.between_steps(generator.load_weights, named, version)
        if any(t.is_cuda for _, t in named):
            torch.cuda.synchronize()
        return len(named)

    async def from_tensor(body: dict[str, Any]) -> str:
        from engines.weights.cuda_ipc import FLATTENED_BUCKET

        entries = _str_list(body, "serialized_named_tensors")
        if not entries or not all(isinstance(e, str) for e in entries):
            raise ValueError("serialized_named_tensors must be a non-empty list of strings")
        load_format = body.get("load_format")
        if load_format not in (None, "direct", FLATTENED_BUCKET):
            raise ValueError(f"load_format {load_format!r} is not one of None, 'direct', "
                             f"{FLATTENED_BUCKET!r}")
        count = await asyncio.to_thread(load_tensor_entry, entries[0], load_format, _version(body))
        return f"Updated {count} tensors (weight_version={generator.weight_version})."

    async def from_disk(body: dict[str, Any]) -> str:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ValueError("model_path must be a non-empty string")
        await asyncio.to_thread(scheduler.between_steps, generator.update_weights_from_disk, path,
                                _version(body))
        return f"Succeeded to update model weights (weight_version={generator.weight_version})."

    async def init_group(body: dict[str, Any]) -> str:
        name = str(body.get("group_name") or "weight_update_group")
        leftover = groups.pop(name, None)
        if leftover is not None:  # a restarted trainer joins again; its old group is dead
            await asyncio.to_thread(leftover.destroy, True)
        from engines.weights.sync import WeightUpdateGroup

        groups[name] = await asyncio.to_thread(
            WeightUpdateGroup,
            str(body["master_address"]),
            int(body["master_port"]),
            int(body["rank_offset"]),
            int(body["world_size"]),
            str(body.get("backend") or "nccl"),
            name,
        )
        return f"Joined {name} as rank {groups[name].rank} of {groups[name].world_size}."

    async def from_distributed(body: dict[str, Any]) -> str:
        name = str(body.get("group_name") or "weight_update_group")
        if name not in groups:
            raise ValueError(f"no weights update group {name!r}: init_weights_update_group first")
        names, dtypes = _str_list(body, "names"), _str_list(body, "dtypes")
        named = await asyncio.to_thread(
            groups[name].receive, names, dtypes, _str_list(body, "shapes")
        )
        await asyncio.to_thread(
            scheduler.between_steps, generator.load_weights, named, _version(body))
        return f"Updated {len(named)} tensors (weight_version={generator.weight_version})."

    async def destroy_group(body: dict[str, Any]) -> str:
        name = str(body.get("group_name") or "weight_update_group")
        group = groups.pop(name, None)
        if group is None:
            raise ValueError(f"no weights update group {name!r}")
        await asyncio.to_thread(group.destroy, bool(body.get("abort")))
        return f"Destroyed {name}."

    async def set_version(body: dict[str, Any]) -> str:
        version = _version(body, "new_version")
        if version is None:
            raise ValueError("new_version is required")
        generator.set_weight_version(version)
        return f"weight_version={version}"

    weight_route("/update_weights_from_tensor", from_tensor)
    weight_route("/update_weights_from_disk", from_disk)
    weight_route("/init_weights_update_group", init_group)
    weight_route("/update_weights_from_distributed", from_distributed)
    weight_route("/destroy_weights_update_group", destroy_group)
    weight_route("/update_weight_version", set_version)

    @app.api_route("/pause_generation", methods=["GET", "POST"])
    async def pause_generation(request: Request) -> Response:
        try:
            mode = str((await json_body(request)).get("mode") or "abort")
            await asyncio.to_thread(scheduler.pause, mode)
        except ValueError as err:
            return error_response(str(err))
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.api_route("/continue_generation", methods=["GET", "POST"])
    async def continue_generation() -> Response:
        scheduler.continue_generation()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def memory(request: Request, action: Callable[[list[str]], None]) -> Response:
        try:
            tags = _tags(await json_body(request))
            await asyncio.to_thread(action, tags)
        except (ValueError, RuntimeError) as err:
            return error_response(str(err))
        return JSONResponse({"success": True, "message": f"tags={tags}"})

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(request: Request) -> Response:
        return await memory(request, scheduler.release_memory)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(request: Request) -> Response:
        return await memory(request, scheduler.resume_memory)

    @app.post("/weights_checker")
    async def weights_checker(request: Request) -> Response:
        try:
            action = str((await json_body(request)).get("action") or "checksum")
            if action != "checksum":
                raise ValueError(f"action must be 'checksum', got {action!r}")
            checksum = await asyncio.to_thread(generator.weights_checksum)
        except (ValueError, RuntimeError) as err:
            return error_response(str(err))
        payload = {"checksum": checksum, "weight_version": str(generator.weight_version)}
        return JSONResponse({"success": True, "message": "sha256", "payload": payload})
