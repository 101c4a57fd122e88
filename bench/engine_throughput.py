"""Embedded engine throughput: many short requests, direct and over HTTP (one batched POST).

    .venv/bin/python -m bench.engine_throughput [--requests 1024] [--prompt 6] [--new 4]

Prints generated tokens per second of `EmbeddedGenerator.generate` and of `/generate` with
SGLang's batched `input_ids`, on the example's tiny Llama (4 layers, 128 wide).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import httpx
import torch

from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.engine_actor import EngineActor
from engines.inference.gen_types import GenRequest, SamplingParams
from examples.arithmetic.build_model import save_tiny_model
from flows.config.run import EngineConfig


def _prompts(n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(4, 40, (n, length), generator=gen).tolist()


def bench_direct(model_dir: str, prompts: list[list[int]], new: int, repeat: int) -> float:
    gen = EmbeddedGenerator(model_dir)
    params = SamplingParams(max_new_tokens=new, ignore_eos=True, sampling_seed=1)
    reqs = [GenRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
    gen.generate(reqs[:8])
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        out = gen.generate(reqs)
        best = min(best, time.perf_counter() - start)
    return sum(len(r.output_ids) for r in out) / best


def bench_http(model_dir: str, prompts: list[list[int]], new: int, repeat: int) -> float:
    actor = EngineActor(EngineConfig(backend="embedded", model_path=model_dir), 0)
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": new, "ignore_eos": True, "sampling_seed": 1},
        "return_logprob": True,
    }
    try:
        best, tokens = float("inf"), 0
        for _ in range(repeat):
            start = time.perf_counter()
            out = httpx.post(f"{actor.url()}/generate", json=body, timeout=600).json()
            best = min(best, time.perf_counter() - start)
            tokens = sum(len(o["output_ids"]) for o in out)
        return tokens / best
    finally:
        actor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--prompt", type=int, default=6)
    parser.add_argument("--new", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared box: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = _prompts(args.requests, args.prompt)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(f"{tmp}/tiny")
        direct = bench_direct(model_dir, prompts, args.new, args.repeat)
        http = bench_http(model_dir, prompts, args.new, args.repeat)
    print(f"{args.requests} requests x {args.prompt} prompt / {args.new} new tokens")
    print(f"direct: {direct:,.0f} tok/s   http batched: {http:,.0f} tok/s")


if __name__ == "__main__":
    main()
