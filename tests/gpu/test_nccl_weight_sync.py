"""`train.weight_sync=distributed` over NCCL: a trainer (this process, GPU 0) pushes weights
to an embedded engine in another process (GPU 1) through `DistributedWeightSender`, and the
engine's sha256 over its weights must equal the trainer's. CPU CI covers the same path over
gloo (`tests/e2e/test_embedded_e2e.py`); this is the GPU transport. Needs 2 GPUs: NCCL
refuses two ranks on one device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.gpu import NCCL_SAFE_ENV, REPO, needs_two

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2), needs_two]
# (layers, hidden, dtype, bucket bytes): a tiny model in many buckets; a ~0.4B one for timing.
CASES = {"tiny-fp32": (4, 128, "float32", 64 * 1024),
         "0.4b-bf16": (24, 1024, "bfloat16", 256 * 1024**2)}


@pytest.fixture(params=list(CASES))
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str, str, int]]:
    from examples.arithmetic.build_model import save_tiny_model

    layers, hidden, dtype, bucket = CASES[request.param]
    model_dir = save_tiny_model(str(tmp_path / "model"), num_layers=layers, hidden_size=hidden)
    env = {**os.environ, **NCCL_SAFE_ENV, "CUDA_VISIBLE_DEVICES": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.gpu.engine_worker", model_dir, dtype], cwd=REPO, env=env,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    if not line.startswith("URL "):
        proc.kill()
        pytest.fail(f"engine did not start: {line!r}")
    try:
        yield line.split()[1], model_dir, dtype, bucket
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.timeout(180)
def test_nccl_weight_sync_matches_trainer(engine: tuple[str, str, str, int]) -> None:
    from transformers import AutoModelForCausalLM

    from engines.weights.sender import DistributedWeightSender, check_weight_update_equal

    url, model_dir, dtype, bucket = engine
    torch.cuda.set_device(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).cuda()
    sender = DistributedWeightSender([url], bucket_bytes=bucket, backend="nccl")
    sender.connect()
    try:
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        for version in (1, 2):
            with torch.no_grad():  # new weights each round, so a stale engine cannot pass
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=1e-2)
            torch.cuda.synchronize()
            start = time.perf_counter()
            versions = sender.update(model, version)
            elapsed = time.perf_counter() - start
            assert versions == [version]
            check_weight_update_equal(model, [url])
            print(f"nccl weight sync {dtype} {nbytes / 2**20:.0f} MiB v{version}: "
                  f"{elapsed:.3f} s ({nbytes / 2**30 / elapsed:.2f} GiB/s)")
    finally:
        sender.close()
