"""Colocated tensor sync in slime's layout on 2 GPUs: two NCCL train ranks, one per GPU,
each a real `TrainActor`, push to engines that record what they get. Every
`serialized_named_tensors` entry holds CUDA IPC handles on the GPU of the train rank it
came from (engine i's entry j: rank i * TP + j), so each SGLang TP rank opens memory on its
own GPU; not colocated, every entry names rank 0's GPU. The devices are read from the
payloads' rebuild arguments, no handle opened. The same plumbing on the CPU, with the
ranks' weights as markers: tests/integration/test_rank_weight_push.py."""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from engines.train.train_actor import TrainActor
from engines.weights.cuda_ipc import FLATTENED_BUCKET
from tests.support.fakes import ExportingBackend
from tests.support.gpu import NCCL_SAFE_ENV, needs_two
from tests.support.rank_push import push_from_two_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2), needs_two]

# (cluster.colocate, cluster.rollout_num_gpus_per_engine, engines, the train rank whose GPU
# each engine's entry j names)
CASES = [
    (True, 2, 1, [[0, 1]]),
    (True, 1, 2, [[0], [1]]),
    (False, 2, 1, [[0, 0]]),
]


def _rank(rank: int, init: str, cfgs: list[Any], urls: list[list[str]], out: str) -> None:
    os.environ.update(NCCL_SAFE_ENV)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank,
                            world_size=2, device_id=torch.device("cuda", rank))
    try:
        for cfg, engine_urls in zip(cfgs, urls, strict=True):
            trainer = TrainActor(cfg, rank, 2)
            trainer.backend = ExportingBackend(fill=float(rank), names=("a", "b"))
            try:
                trainer.push_weights(engine_urls)
            finally:
                trainer.close_weight_sender()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"uuid": str(torch.cuda.get_device_properties(rank).uuid)}, f)
    finally:
        dist.destroy_process_group()


class _Stub:
    """Stands in for every global but the CUDA tensor rebuild while a payload is read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def handle_devices(entry: str) -> list[str]:
    """The device (a GPU UUID, as engines.weights.cuda_ipc writes it) of each CUDA tensor
    an entry rebuilds: argument 6 of torch's `rebuild_cuda_tensor`."""
    devices: list[str] = []

    class Reader(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if name == "rebuild_cuda_tensor":
                return lambda *args: devices.append(args[6])
            return _Stub

    Reader(io.BytesIO(base64.b64decode(entry))).load()
    return devices


def test_each_entry_holds_handles_on_its_train_ranks_gpu(tmp_path: Path) -> None:
    engines = push_from_two_ranks(tmp_path, _rank, [case[:3] for case in CASES])
    uuids = [json.loads((tmp_path / f"rank{r}.json").read_text())["uuid"] for r in range(2)]
    assert uuids[0] != uuids[1]
    for (colocate, tp, _, expected), case in zip(CASES, engines, strict=True):
        for engine, ranks in zip(case, expected, strict=True):
            assert len(engine.tensor_updates) == 2  # one per bucket
            for update in engine.tensor_updates:
                assert update["load_format"] == FLATTENED_BUCKET
                got = [handle_devices(e) for e in update["serialized_named_tensors"]]
                assert got == [[uuids[r]] for r in ranks], (colocate, tp, len(case))
