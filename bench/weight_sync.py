"""Colocated weight sync on one GPU: SGLang's CUDA IPC handles vs weights as bytes.

The trainer's model (this process) and an embedded engine (`rollflow engine`, another
process) share the GPU, as in a colocated run. Each repeat changes the weights, pushes them
with `TensorWeightSender` (pause, `/update_weights_from_tensor` per bucket, flush, continue)
and times it; the engine's checksum must then equal the trainer's.

- `ipc`: the CUDA tensors travel as CUDA IPC handles in flattened buckets (SGLang's format);
- `bytes`: the same weights copied to the CPU and sent as base64 `torch.save` (what a CPU
  trainer sends; the bytes cost of the old colocated path, which also went through the CPU).

    python -m bench.weight_sync [--shape qwen2|tiny] [--repeats 5] [--bytes-repeats 2]

Figures: bench/RESULTS.md, "Colocated weight sync".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from engines.process import free_port, wait_for_health
from engines.weights.cuda_ipc import payload_globals
from engines.weights.sender import ModuleWeights, TensorWeightSender, check_weight_update_equal

REPO = Path(__file__).resolve().parents[1]


class CpuCopies(ModuleWeights):
    """The model's weights copied to the CPU at export: the bytes path's input."""

    def export_weights(self) -> Mapping[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in super().export_weights().items()}


def save_model(path: str, shape: str) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.megatron_grpo import QWEN2_05B

    dims = dict(QWEN2_05B) if shape == "qwen2" else dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**dims)).to(torch.bfloat16).save_pretrained(path)
    return path


def start_engine(model_dir: str, dtype: str = "bfloat16") -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "engine", "--model-path", model_dir,
                             "--port", str(port), "--device", "cuda", "--dtype", dtype], env=env)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(url, lambda: proc.poll() is None, 300.0, what="engine")
    return proc, url


def time_updates(sender: TensorWeightSender, model: torch.nn.Module, source: ModuleWeights,
                 first_version: int, repeats: int) -> list[float]:
    seconds = []
    for i in range(repeats):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.001)
        torch.cuda.synchronize()
        start = time.perf_counter()
        sender.update(source, first_version + i)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["qwen2", "tiny"], default="qwen2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bytes-repeats", type=int, default=2, help="the bytes path takes seconds")
    ap.add_argument("--bucket-mib", type=int, default=512)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(str(Path(tmp, "model")), args.shape)
        engine, url = start_engine(model_dir)
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
            nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
            sender = TensorWeightSender([url], args.bucket_mib * 1024**2)
            rows = []
            for method, source in (("ipc", ModuleWeights(model)), ("bytes", CpuCopies(model))):
                version = 1 + len(rows) * args.repeats  # versions of both methods differ
                repeats = args.repeats if method == "ipc" else args.bytes_repeats
                seconds = time_updates(sender, model, source, version, repeats)
                check_weight_update_equal(model, [url])  # raises unless the engine matches
                request_bytes = [len(e) for _, e in sender.encode(
                    list(source.export_weights().items())[:1])]
                sender.release()
                rows.append({"method": method, "weights_mib": round(nbytes / 2**20, 1),
                             "first_s": round(seconds[0], 4),
                             "median_s": round(statistics.median(seconds[1:] or seconds), 4),
                             "all_s": [round(s, 4) for s in seconds],
                             "first_request_bytes": request_bytes[0],
                             "engine_checksum_equal": True})
                if method == "ipc":
                    entry = sender.encode(list(model.state_dict().items())[:2])[0][1]
                    sender.release()
                    rows[-1]["payload_globals"] = sorted(payload_globals(entry))
                print(json.dumps(rows[-1]), flush=True)
            sender.close()
            print("device", torch.cuda.get_device_name(), "shape", args.shape,
                  "buckets of", args.bucket_mib, "MiB")
        finally:
            engine.terminate()
            engine.wait(timeout=60)


if __name__ == "__main__":
    main()
