"""The embedded engine's decode on a GPU without HTTP: `EmbeddedGenerator.generate` of
`--batch` requests x `--new-tokens` tokens on the Qwen2-0.5B-shaped random model (bf16),
through its CUDA-graph turns, with and without `torch.compile` of the layers, sampled
(temperature 1) and greedy; then the top CUDA kernels of one generate. Where a step's GPU
time goes is what decides the next optimisation (bench/generation.py measures the same
engine over its HTTP API against HF `generate`).

    python -m bench.gpu_decode [--compile off on] [--steps-per-turn 8 32] [--profile]

Results: bench/RESULTS.md, "Embedded engine vs HF generate on a GPU".
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    from transformers import AutoTokenizer

    from bench.generation import prompt_ids
    from engines.inference.embedded_generator import EmbeddedGenerator
    from engines.inference.gen_types import GenRequest, SamplingParams
    from scripts.gpu.e2e import save_qwen2_shaped

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--compile", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--steps-per-turn", type=int, nargs="+", default=[8])
    parser.add_argument("--profile", action="store_true", help="top CUDA kernels of one generate")
    args = parser.parse_args()
    path = save_qwen2_shaped(Path(tempfile.mkdtemp()) / "qwen2-0.5b", quick=False)
    ids = prompt_ids(AutoTokenizer.from_pretrained(path), args.batch, args.prompt_len)

    def requests(tag: str, temperature: float) -> list[GenRequest]:
        return [GenRequest(f"{tag}{i}", x, SamplingParams(
            max_new_tokens=args.new_tokens, temperature=temperature, ignore_eos=True,
            sampling_seed=i)) for i, x in enumerate(ids)]  # fmt: skip

    gen = None
    for compiled in args.compile:
        gen = EmbeddedGenerator(path, dtype="bfloat16", device="cuda",
                                torch_compile=compiled == "on")
        start = time.perf_counter()
        gen.generate(requests("warm", 1.0))
        print(f"compile {compiled}: first generate (graph capture, compile) "
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
                print(f"compile {compiled}, {steps} steps a turn, temperature {temperature}: "
                      f"{seconds:.3f} s, {tokens / seconds:.0f} tok/s, graphs captured so far "
                      f"{gen._graphs.captures}", flush=True)
    if args.profile and gen is not None:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            gen.generate(requests("profile", 1.0))
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=16,
                                        max_name_column_width=50))


if __name__ == "__main__":
    main()
