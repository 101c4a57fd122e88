"""An embedded rollout engine in a process of its own, for `test_nccl_weight_sync.py`:

    CUDA_VISIBLE_DEVICES=1 python -m tests.gpu.engine_worker MODEL_DIR [DTYPE]

Prints `URL <url>` once its SGLang-compatible server is healthy, then serves until stdin
closes. The engine's model sits on this process's GPU (engine.device auto); weights sent
over NCCL arrive there and are copied in, as on a disaggregated rollout node.
"""

from __future__ import annotations

import os
import sys

import torch

from engines.inference.engine_actor import EngineActor
from flows.config.run import EngineConfig


def main() -> None:
    model_dir, dtype = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "float32"
    torch.cuda.set_device(0)  # the group's NCCL device: the one GPU this process sees
    cfg = EngineConfig.model_validate({"backend": "embedded", "model_path": model_dir, "dtype": dtype})
    actor = EngineActor(cfg, 0, num_threads=4, startup_timeout_s=300.0)
    print(f"URL {actor.url()}", flush=True)
    sys.stdin.read()  # the test closes our stdin when it is done
    actor.shutdown()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: NCCL / CUDA destructors can stall the exit


if __name__ == "__main__":
    main()
