"""Where the megatron backend's first train step goes (the main job's step 0 took 7.5-8.4 s
of set-up on the GPU against ~0.5 s for later steps): times the backend's construction and
steps 0-2 on the arithmetic model, with torch.compile's own compile times and the top
functions of step 0 by cumulative time.

    python scripts/gpu/first_step.py [--steps 3] [--top 25]

Measured on an H100 (megatron-core 0.19.2, fp32): backend init 4.6 s; step 0 with cold
caches compiles four graphs (token_stats' stats and grad, megatron's swiglu forward and
backward), 8.7 s of torch.compile; with the Inductor/Triton caches a previous process left
on the machine, step 0 takes 2.8 s; later steps 0.03 s.
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

sys.path.insert(0, os.getcwd())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    import torch

    from engines.algorithms.config import AlgorithmConfig
    from engines.train.config import TrainConfig
    from examples.arithmetic.build_model import save_tiny_model
    from tests.gpu._data import grpo_samples

    t0 = time.perf_counter()
    model_dir = save_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny-llama"))
    from engines.train.megatron import MegatronTrainBackend

    t1 = time.perf_counter()
    cfg = TrainConfig(model_path=model_dir, lr=1e-4, dtype="float32", seed=1,
                      max_tokens_per_micro_batch=8192)
    backend = MegatronTrainBackend(cfg, AlgorithmConfig())
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"model {t1 - t0:.2f} s (incl. megatron import), backend init {t2 - t1:.2f} s",
          flush=True)
    samples = grpo_samples(n_groups=16, group=8, vocab=64)
    for step in range(args.steps):
        prof = cProfile.Profile() if step == 0 else None
        start = time.perf_counter()
        if prof:
            prof.enable()
        backend.train(samples, step)
        torch.cuda.synchronize()
        if prof:
            prof.disable()
        print(f"step {step}: {time.perf_counter() - start:.2f} s", flush=True)
        if prof:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(args.top)
            print(out.getvalue()[-6000:], flush=True)
    from torch._dynamo.utils import compile_times

    print(compile_times(repr="str"), flush=True)


if __name__ == "__main__":
    main()
