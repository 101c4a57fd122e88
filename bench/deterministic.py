"""What `train.deterministic` costs: embedded-engine generation and torch train steps, in
the default mode and the deterministic one, interleaved in one process (so both modes see
the same machine load).

Generation calls the generator directly (no HTTP), seeded sampling at temperature 1, each
batch a GRPO-like batch of prompts x 8 samples. A train step is one `train()` of the arithmetic
example's shape (6-token prompts, 4-token responses, 8 per prompt, two optimizer steps).

    python -m bench.deterministic --model examples/arithmetic/artifacts/tiny-llama
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.train_step import make_samples
from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.gen_types import GenRequest, SamplingParams
from engines.train.torch_backend import TorchTrainBackend
from flows.config.run import AlgorithmConfig, TrainConfig

PROMPTS = ["12+34=", "7+58=", "90+9=", "41+41=", "3+66=", "25+70=", "8+8=", "60+17="]


def generation(model: str, batch: int, new_tokens: int, repeats: int, threads: int
               ) -> dict[bool, tuple[float, float]]:
    """tokens/s and CPU seconds per 1,000 tokens (all threads; less moved by other
    processes on a shared machine) of each mode, best of `repeats` alternating calls."""
    engines = {mode: EmbeddedGenerator(model, num_threads=threads, device="cpu",
                                       continuous_steps=8, batch_invariant=mode)
               for mode in (False, True)}
    best, cpu = {False: 0.0, True: 0.0}, {False: float("inf"), True: float("inf")}
    for r in range(repeats + 1):
        for mode, engine in engines.items():
            reqs = [GenRequest(f"{r}-{i}", engine.tokenize(PROMPTS[i // 8 % len(PROMPTS)]),
                               SamplingParams(max_new_tokens=new_tokens, ignore_eos=True,
                                              sampling_seed=i)) for i in range(batch)]
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.generate(reqs)
            if r:  # (the first round warms up)
                best[mode] = max(best[mode], batch * new_tokens / (time.perf_counter() - start))
                cpu[mode] = min(cpu[mode], (time.process_time() - cpu_start) * 1000 / (batch * new_tokens))
    return {mode: (best[mode], cpu[mode]) for mode in best}


def train_steps(model: str, samples: int, repeats: int, threads: int) -> dict[bool, float]:
    """Seconds per train step of each mode, best of `repeats` alternating steps."""
    backends = {mode: TorchTrainBackend(
        TrainConfig(model_path=model, lr=1e-5, global_batch_size=samples // 2,
                    deterministic=mode), AlgorithmConfig(), num_threads=threads)
        for mode in (False, True)}
    batch = make_samples(samples, int(backends[False].model.config.vocab_size), 6, 4)
    best = {False: float("inf"), True: float("inf")}
    for r in range(repeats + 1):
        for mode, backend in backends.items():
            start = time.perf_counter()
            backend.train(batch, r)
            if r:
                best[mode] = min(best[mode], time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/arithmetic/artifacts/tiny-llama")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 1024])
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--train-samples", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    torch.manual_seed(0)
    for batch in args.batch_sizes:
        (tps, cpu), (tps_d, cpu_d) = generation(
            args.model, batch, args.new_tokens, args.repeats, args.threads).values()
        print(f"generation batch {batch:5d}: default {tps:9,.0f} tok/s {cpu:6.3f} CPU s/1k tok"
              f"  deterministic {tps_d:9,.0f} tok/s {cpu_d:6.3f} CPU s/1k tok "
              f"({tps_d / tps:.2f}x tok/s, {cpu_d / cpu:.2f}x CPU)", flush=True)
    step = train_steps(args.model, args.train_samples, args.repeats, args.threads)
    print(f"train step {args.train_samples} samples: default {step[False]:.3f} s  deterministic "
          f"{step[True]:.3f} s  ({step[True] / step[False]:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
