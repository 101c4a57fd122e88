"""Where the megatron backend's first train step goes (the main job's step 0 takes several
seconds of set-up on the GPU, later steps a fraction of one): times the backend's construction and
steps 0-2 on the arithmetic model, with torch.compile's own compile times and the top
functions of step 0 by cumulative time.

    python scripts/gpu/first_step.py [--steps 3] [--top 25]
    torchrun --nproc-per-node 2 scripts/gpu/first_step.py --exports 3   # TP=2, rank 0 prints

`--exports N` also times N weight exports (`export_weights`, the engines' copy: TP shards
gathered) before step 0 and after the last step, the first of them profiled.

Step 0 with cold caches compiles four graphs (token_stats' stats and grad, megatron's swiglu
forward and backward); the Inductor/Triton caches a previous process left on the machine
make it much shorter. Results: bench/RESULTS.md, "Megatron's first step".
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.getcwd())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--exports", type=int, default=0)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    show = int(os.environ.get("RANK", "0")) == 0

    from engines.config.algorithm import AlgorithmConfig
    from engines.config.train import TrainConfig
    from examples.arithmetic.build_model import save_tiny_model
    from tests.support.gpu import grpo_samples

    t0 = time.perf_counter()
    model_dir = os.path.join(tempfile.gettempdir(), "first-step-tiny-llama")
    if show:
        save_tiny_model(model_dir)
    if world > 1:
        dist.barrier()
    from engines.train.megatron import MegatronTrainBackend

    t1 = time.perf_counter()
    cfg = TrainConfig(model_path=model_dir, lr=1e-4, dtype="float32", seed=1,
                      max_tokens_per_micro_batch=8192)
    backend = MegatronTrainBackend(cfg, AlgorithmConfig(), tensor_parallel=world)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    say = print if show else (lambda *a, **k: None)
    say(f"model {t1 - t0:.2f} s (incl. megatron import), backend init {t2 - t1:.2f} s (TP={world})",
        flush=True)

    def timed(what: str, call: Any, profile: bool) -> None:
        prof = cProfile.Profile() if profile else None
        start = time.perf_counter()
        if prof:
            prof.enable()
        call()
        torch.cuda.synchronize()
        if prof:
            prof.disable()
        say(f"{what}: {time.perf_counter() - start:.2f} s", flush=True)
        if prof and show:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
            print(out.getvalue()[-6000:], flush=True)

    for i in range(args.exports):
        timed(f"export {i} (before step 0)", backend.export_weights, i == 0)
    samples = grpo_samples(n_groups=16, group=8, vocab=64)
    for step in range(args.steps):
        timed(f"step {step}", lambda s=step: backend.train(samples, s), step == 0)
    for i in range(args.exports):
        timed(f"export {i} (after step {args.steps - 1})", backend.export_weights, False)
    from torch._dynamo.utils import compile_times

    say(compile_times(repr="str"), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
