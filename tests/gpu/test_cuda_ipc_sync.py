"""Colocated weight sync through SGLang's CUDA IPC format, trainer and engine in two
processes on one GPU: the engine ends with the trainer's weights, copied (the trainer may
change its own afterwards), and the payload names only globals SGLang's SafeUnpickler
admits."""

from __future__ import annotations

import httpx
import torch

from bench.weight_sync import start_engine
from engines.weights.cuda_ipc import FLATTENED_BUCKET, payload_globals
from engines.weights.sender import TensorWeightSender, check_weight_update_equal
from engines.weights.sync import weights_checksum
from tests.unit.test_cuda_ipc_format import SGLANG_ADMITS


def test_cuda_ipc_update_reaches_the_engine_as_a_copy(qwen2_tiny_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    engine, url = start_engine(qwen2_tiny_dir, dtype="float32")
    try:
        model = AutoModelForCausalLM.from_pretrained(qwen2_tiny_dir).cuda()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        sender = TensorWeightSender([url], bucket_bytes=64 * 1024)  # several buckets
        requests = sender.encode(list(model.state_dict().items()))
        sender.release()
        assert {fmt for fmt, _ in requests} == {FLATTENED_BUCKET}
        entry = requests[0][1]
        assert len(entry) < 4096  # handles, not weights
        names = payload_globals(entry)
        assert "torch.multiprocessing.reductions.rebuild_cuda_tensor" in names
        assert all(any(n.startswith(p) for p in SGLANG_ADMITS) for n in names), names

        assert sender.update(model, 5) == [5]
        sent = check_weight_update_equal(model, [url])
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(2.0)
        got = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=60).json()
        assert got["payload"]["checksum"] == sent != weights_checksum(model.state_dict().items())
        assert sender.update(model, 6) == [6]
        check_weight_update_equal(model, [url])
        sender.close()
    finally:
        engine.terminate()
        engine.wait(timeout=60)
