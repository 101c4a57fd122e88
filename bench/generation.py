"""Generated tokens per second: the embedded engine (over its SGLang HTTP API) against
Hugging Face `generate`, on the same tiny model, at several batch sizes.

Both sample at temperature 1 with EOS ignored, so every request yields exactly
`--new-tokens` tokens and the two sides do the same work; both use the same torch thread
count. The engine's figure includes HTTP and JSON, i.e. what the generation loop sees.
Usage:
  python -m bench.generation --batch-sizes 1 16 64 --new-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from typing import Any

import torch

PROMPTS = ["12+34=", "7+58=", "99+1=", "40+40=", "3+77=", "65+19=", "8+8=", "21+55="]


def build_model(path: str | None) -> str:
    from examples.arithmetic.build_model import save_tiny_model

    if path:
        return path
    return save_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny-llama"))


def prompt_ids(tokenizer: Any, batch: int) -> list[list[int]]:
    return [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]


def bench_engine(model_dir: str, batch: int, new_tokens: int, threads: int, repeats: int) -> float:
    from transformers import AutoTokenizer

    from engines.rollout.engine_actor import EngineActor
    from engines.rollout.sglang_client import SGLangClient
    from flows.config import EngineConfig

    engine = EngineActor(EngineConfig(backend="embedded", model_path=model_dir), 0, threads)
    ids = prompt_ids(AutoTokenizer.from_pretrained(model_dir), batch)
    params = [{"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True,
               "sampling_seed": i} for i in range(batch)]

    async def once() -> int:
        async with SGLangClient(engine.url()) as client:
            outs = await client.generate_batch(ids, params)
        return sum(len(o.output_ids) for o in outs)

    try:
        asyncio.run(once())  # warm-up
        start, tokens = time.perf_counter(), 0
        for _ in range(repeats):
            tokens += asyncio.run(once())
        return tokens / (time.perf_counter() - start)
    finally:
        engine.shutdown()


def bench_hf(model_dir: str, batch: int, new_tokens: int, threads: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = prompt_ids(tokenizer, batch)
    width = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])  # left padding
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])

    def once() -> int:
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0,
                top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                pad_token_id=pad,
            )
        return int((out.shape[1] - width) * batch)

    once()
    start, tokens = time.perf_counter(), 0
    for _ in range(repeats):
        tokens += once()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/arithmetic/artifacts/tiny-llama",
                        help="HF model dir ('' builds the tiny model in a temp dir)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model_dir = build_model(args.model or None)
    print(f"model {model_dir}, {args.new_tokens} new tokens/request, {args.threads} threads")
    print(f"{'batch':>6} {'embedded tok/s':>15} {'HF generate tok/s':>18} {'ratio':>7}")
    for batch in args.batch_sizes:
        engine = bench_engine(model_dir, batch, args.new_tokens, args.threads, args.repeats)
        hf = bench_hf(model_dir, batch, args.new_tokens, args.threads, args.repeats)
        print(f"{batch:>6} {engine:>15.1f} {hf:>18.1f} {engine / hf:>7.2f}")


if __name__ == "__main__":
    main()
