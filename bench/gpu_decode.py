"""The embedded engine's decode on a GPU without HTTP: `EmbeddedGenerator.generate` of
`--batch` requests x `--new-tokens` tokens on the Qwen2-0.5B-shaped random model (bf16),
through its CUDA-graph turns, with and without `torch.compile` of the layers, sampled
(temperature 1) and greedy; then the top CUDA kernels of one generate. Where a step's GPU
time goes is what decides the next optimisation (bench/generation.py measures the same
engine over its HTTP API against HF `generate`).

    python -m bench.gpu_decode [--compile off on] [--triton off on] [--steps-per-turn 8 32]
        [--profile]

Results: bench/RESULTS.md, "Embedded engine vs HF generate on a GPU".
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def main() -> None:
    from transformers import AutoTokenizer

    from bench.generation import prompt_ids
    from engines.inference.embedded_generator import EmbeddedGenerator
    from engines.inference.gen_types import GenRequest, SamplingParams
    from engines.inference.kv_decode import TRITON_SWITCH
    from scripts.gpu.e2e import save_qwen2_shaped

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--compile", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--steps-per-turn", type=int, nargs="+", default=[8])
    parser.add_argument("--triton", nargs="+", choices=["off", "on"], default=["on"],
                        help="the captured step's Triton kernels (`triton_decode`); compiled "
                        "layers run without them")
    parser.add_argument("--profile", action="store_true",
                        help="top CUDA kernels and host ops of one generate, per engine")
    parser.add_argument("--http", action="store_true",
                        help="also one engine's generate direct, through its scheduler and "
                        "over HTTP (where a bench.generation figure loses to this one's)")
    parser.add_argument("--trace", default="",
                        help="with --profile: a directory for each profile's gzipped trace")
    args = parser.parse_args()
    path = save_qwen2_shaped(Path(tempfile.mkdtemp()) / "qwen2-0.5b", quick=False)
    ids = prompt_ids(AutoTokenizer.from_pretrained(path), args.batch, args.prompt_len)

    def requests(tag: str, temperature: float) -> list[GenRequest]:
        return [GenRequest(f"{tag}{i}", x, SamplingParams(
            max_new_tokens=args.new_tokens, temperature=temperature, ignore_eos=True,
            sampling_seed=i)) for i, x in enumerate(ids)]  # fmt: skip

    for compiled in args.compile:
        for triton in ["off"] if compiled == "on" else args.triton:
            os.environ[TRITON_SWITCH] = "1" if triton == "on" else "0"
            gen = EmbeddedGenerator(path, dtype="bfloat16", device="cuda",
                                    torch_compile=compiled == "on")
            name = f"compile {compiled}, triton {triton}"
            start = time.perf_counter()
            gen.generate(requests("warm", 1.0))
            print(f"{name}: first generate (graph capture, compile) "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
            for steps in args.steps_per_turn:
                gen.continuous_steps = steps
                for temperature in (1.0, 0.0):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    out = gen.generate(requests(f"t{steps}-{temperature}", temperature))
                    seconds = time.perf_counter() - start
                    tokens = sum(len(o.output_ids) for o in out)
                    assert gen._graphs is not None
                    print(f"{name}, {steps} steps a turn, temperature {temperature}: "
                          f"{seconds:.3f} s, {tokens / seconds:.0f} tok/s, graphs captured so "
                          f"far {gen._graphs.captures}", flush=True)
            if args.profile:
                gen.continuous_steps = args.steps_per_turn[0]
                profile_generate(name, gen, requests("profile", 1.0), args.trace)
            del gen
            torch.cuda.empty_cache()
    if args.http:
        http_costs(path, ids, args.new_tokens, requests)


def http_costs(path: str, ids: list[list[int]], new_tokens: int, requests: Any) -> None:
    """One engine (CUDA graphs, Triton kernels) timed three ways, alternately: its generator
    called directly, its scheduler's `submit`, and bench.generation's HTTP runner."""
    from bench.generation import EngineRunner
    from engines.config.engine import EngineConfig
    from engines.inference.engine_actor import EngineActor
    from engines.inference.kv_decode import TRITON_SWITCH

    os.environ.pop(TRITON_SWITCH, None)
    actor = EngineActor(EngineConfig(backend="embedded", model_path=path, dtype="bfloat16",
                                     device="cuda"), 0, 1)
    runner = EngineRunner(actor.url(), ids, new_tokens, 1.0)
    ways = {
        "direct": lambda tag: actor.generator.generate(requests(tag, 1.0)),
        "scheduler": lambda tag: actor.scheduler.submit(requests(tag, 1.0)).result(),
        "http": lambda tag: runner(),
    }
    try:
        for way in ways.values():
            way("warm")
        for i in range(3):
            for name, way in ways.items():
                start = time.perf_counter()
                out = way(f"{name}{i}")
                seconds = time.perf_counter() - start
                tokens = sum(len(getattr(o, "output_ids", o)) for o in out)
                print(f"{name}: {seconds:.3f} s, {tokens / seconds:.0f} tok/s", flush=True)
    finally:
        runner.close()
        actor.shutdown()


def profile_generate(name: str, gen: Any, requests: list[Any], trace: str = "") -> None:
    """One generate under the profiler: its wall time against the GPU's kernel time, the
    top kernels and the top host ops (what the GPU waits on between kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                 record_shapes=True) as prof:
        start = time.perf_counter()
        gen.generate(requests)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    kernels = sum(e.self_device_time_total for e in events) / 1e6
    print(f"{name}: profiled generate {wall:.3f} s wall (profiler on), kernels {kernels:.3f} s")
    print(events.table(sort_by="self_cuda_time_total", row_limit=24, max_name_column_width=60))
    print(events.table(sort_by="cpu_time_total", row_limit=24, max_name_column_width=60))
    shaped = prof.key_averages(group_by_input_shape=True)
    print(shaped.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=40,
                       max_shapes_column_width=80))
    if trace:
        import gzip
        import shutil

        Path(trace).mkdir(parents=True, exist_ok=True)
        raw = Path(trace) / f"{name.replace(', ', '_').replace(' ', '-')}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()

if __name__ == "__main__":
    main()
