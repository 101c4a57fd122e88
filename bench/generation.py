"""Generated tokens per second: the embedded engine (over its SGLang HTTP API) against
Hugging Face `generate`, on the same tiny model, at several batch sizes.

Both sample at temperature 1 with EOS ignored, so every request yields exactly
`--new-tokens` tokens and the two sides do the same work. Both may use up to `--threads`
torch threads, and each uses what is fastest for it: the engine picks per forward (one
thread for small ones), HF the cheaper of 1 and `--threads` in CPU time, timed once per
batch size (the `HF thr` column); on a 2-core box small batches run faster on one thread,
so a fixed count would handicap HF. The engine's figure includes HTTP and JSON, i.e. what
the generation loop sees.
The two run alternately in one process (`--repeats` pairs) and the table shows medians,
so load from other processes on a shared machine hits both alike; `cpu ratio` compares the
process CPU time each side spends per token, which such load disturbs far less than wall
time. Before timing, each batch
size checks that greedy outputs equal HF's token for token and that the engine's log-probs
are within 1e-5 of a full-sequence forward; a failed check exits non-zero.
OpenMP threads sleep while idle (`OMP_WAIT_POLICY=PASSIVE` unless set): spinning workers on
a shared machine made both sides far slower and the figures mostly noise (bench/RESULTS.md,
"Embedded engine vs HF generate").
On a GPU (`--device cuda`) the engine runs its CUDA-graph decode turns (`engine
compiled`: with `engine.enable_torch_compile`; `engine eager`: with
`engine.disable_cuda_graph`) against HF `generate` with its
dynamic and its static cache, all in `--dtype`; the greedy and log-prob checks run first
on the first `--check-rows` rows in float32 (in bfloat16 a random model's near-flat logits
make greedy choices a coin toss between two kernels' roundings). `--model qwen2-0.5b`
builds the Qwen2-0.5B-shaped random model of the GPU benches, fed `--prompt-len` random
token ids per request.
Usage:
  python -m bench.generation --batch-sizes 1 16 64 --new-tokens 64
  python -m bench.generation --device cuda --model qwen2-0.5b --dtype bfloat16 \
      --batch-sizes 64 256 --new-tokens 256 --repeats 2
  python -m bench.generation --device cuda --model qwen2-0.5b --dtype bfloat16 --fp8 ...
      (adds the engine with engine.dtype fp8, and each engine dtype's log-prob gap to a
      --dtype full forward: the mismatch a trainer in that dtype sees)
Results: bench/RESULTS.md, "Embedded engine vs HF generate" (CPU) and "... on a GPU".
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when OpenMP starts

import argparse  # noqa: E402
import asyncio  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

LOGPROB_TOL = 1e-5

PROMPTS = ["12+34=", "7+58=", "99+1=", "40+40=", "3+77=", "65+19=", "8+8=", "21+55="]


QWEN2_05B = "qwen2-0.5b"


def build_model(path: str | None) -> str:
    from examples.arithmetic.build_model import save_tiny_model

    if path == QWEN2_05B:
        from pathlib import Path

        from scripts.gpu.e2e import save_qwen2_shaped

        return save_qwen2_shaped(Path(tempfile.mkdtemp()) / QWEN2_05B, quick=False)
    if path:
        return path
    return save_tiny_model(os.path.join(tempfile.mkdtemp(), "tiny-llama"))


def prompt_ids(tokenizer: Any, batch: int, random_len: int = 0) -> list[list[int]]:
    """The example's arithmetic prompts, or (`random_len`) random ids past the tokenizer's
    vocabulary, between half and all of `random_len` long (rows left-padded differently)."""
    if not random_len:
        return [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    low = len(tokenizer)
    return [torch.randint(low, low + 20_000, (int(n),), generator=gen).tolist()
            for n in torch.randint(random_len // 2, random_len + 1, (batch,), generator=gen)]


class EngineRunner:
    """One batched `/generate` over HTTP per call; returns the parsed outputs. The client
    (and its HTTP session) lives across calls in one event loop, as a rollout's does: a
    session and loop made per call cost a visible share of a batch (bench/RESULTS.md,
    "Embedded engine vs HF generate")."""

    def __init__(self, url: str, ids: list[list[int]], new_tokens: int, temperature: float):
        from engines.rollout.sglang_client import SGLangClient

        self.ids = ids
        self.params = [{"max_new_tokens": new_tokens, "temperature": temperature,
                        "ignore_eos": True, "sampling_seed": i} for i in range(len(ids))]
        self.loop = asyncio.new_event_loop()
        self.client = SGLangClient(url)

    def __call__(self) -> list[Any]:
        return self.loop.run_until_complete(self.client.generate_batch(self.ids, self.params))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


def engine_outputs(url: str, ids: list[list[int]], new_tokens: int, temperature: float) -> list[Any]:
    runner = EngineRunner(url, ids, new_tokens, temperature)
    try:
        return runner()
    finally:
        runner.close()


def hf_runner(
    model: Any, pad: int, ids: list[list[int]], new_tokens: int, sample: bool,
    cache: str = "dynamic",
) -> Callable[[], list[list[int]]]:
    """HF `generate` on the left-padded batch, with its `dynamic` or `static` KV cache;
    returns each row's new tokens."""
    width = max(len(x) for x in ids)
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=model.device)
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=model.device)
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": 1.0, "top_k": 0} if sample else {
        "do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    if cache == "static":
        kwargs["cache_implementation"] = "static"

    def once() -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, pad_token_id=pad, **kwargs,
            )
        return [row[width:] for row in out.tolist()]

    return once


def check_outputs(model: Any, pad: int, ids: list[list[int]], url: str, new_tokens: int) -> str:
    """Greedy equality with HF generate and log-probs against a full forward, or an error."""
    greedy = engine_outputs(url, ids, new_tokens, 0.0)
    reference = hf_runner(model, pad, ids, new_tokens, sample=False)()
    differ = [i for i, (o, r) in enumerate(zip(greedy, reference, strict=True)) if o.output_ids != r]
    if differ:
        return f"greedy outputs differ from HF generate in rows {differ[:8]}"
    worst = 0.0
    for prompt, out in zip(ids, engine_outputs(url, ids, new_tokens, 1.0), strict=True):
        full = torch.tensor([prompt + out.output_ids], device=model.device)
        with torch.inference_mode():
            logp = torch.log_softmax(model(full).logits[0, len(prompt) - 1 : -1].float(), -1)
        ref = logp.gather(1, torch.tensor(out.output_ids, device=model.device)[:, None])[:, 0].cpu()
        worst = max(worst, float((ref - torch.tensor(out.log_probs)).abs().max()))
    return "" if worst < LOGPROB_TOL else f"log-probs off a full forward by {worst:.2e}"


def logprob_gap(model: Any, ids: list[list[int]], url: str, new_tokens: int) -> tuple[float, float]:
    """Mean and largest |engine log-prob - `model`'s full-forward log-prob| over the tokens
    the engine samples (temperature 1): the rollout-training mismatch an engine dtype brings
    against a trainer that holds `model`."""
    gaps = []
    for prompt, out in zip(ids, engine_outputs(url, ids, new_tokens, 1.0), strict=True):
        full = torch.tensor([prompt + out.output_ids], device=model.device)
        with torch.inference_mode():
            logp = torch.log_softmax(model(full).logits[0, len(prompt) - 1 : -1].float(), -1)
        ref = logp.gather(1, torch.tensor(out.output_ids, device=model.device)[:, None])[:, 0]
        gaps.append((ref.cpu() - torch.tensor(out.log_probs)).abs())
    gap = torch.cat(gaps)
    return float(gap.mean()), float(gap.max())


def cpu_seconds(run: Callable[[], object]) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def hf_threads(run: Callable[[], object], threads: int) -> int:
    """HF's best thread count for this batch: the one of {1, threads} that spends the
    least CPU time on the better of two runs each (this process's main thread runs HF)."""
    cost = {}
    for count in sorted({1, threads}):
        torch.set_num_threads(count)
        cost[count] = min(cpu_seconds(run) for _ in range(2))
    return min(cost, key=cost.__getitem__)


def bench_batch(
    model_dir: str, batch: int, new_tokens: int, threads: int, repeats: int
) -> tuple[float, float, float, float, int, str]:
    """(engine tok/s, HF tok/s, median ratio, median CPU-time ratio, HF's thread count,
    check error or ''), timing the two alternately."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines.config.engine import EngineConfig
    from engines.inference.engine_actor import EngineActor

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = prompt_ids(tokenizer, batch)
    engine = EngineActor(EngineConfig(backend="embedded", model_path=model_dir), 0, threads)
    try:
        error = check_outputs(model, pad, ids, engine.url(), new_tokens)
        engine_run = EngineRunner(engine.url(), ids, new_tokens, 1.0)
        runners = (engine_run, hf_runner(model, pad, ids, new_tokens, sample=True))
        rates: tuple[list[float], list[float]] = ([], [])
        cpu: tuple[list[float], list[float]] = ([], [])
        runners[0]()  # warm-up
        hf_count = hf_threads(runners[1], threads)
        for _ in range(repeats):
            for run, out, out_cpu in zip(runners, rates, cpu, strict=True):
                start, start_cpu = time.perf_counter(), time.process_time()
                tokens = sum(len(getattr(o, "output_ids", o)) for o in run())
                out.append(tokens / (time.perf_counter() - start))
                out_cpu.append(tokens / (time.process_time() - start_cpu))
        engine_run.close()
    finally:
        engine.shutdown()
    ratio = statistics.median(e / h for e, h in zip(*rates, strict=True))
    cpu_ratio = statistics.median(e / h for e, h in zip(*cpu, strict=True))
    return (statistics.median(rates[0]), statistics.median(rates[1]), ratio, cpu_ratio,
            hf_count, error)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="examples/arithmetic/artifacts/tiny-llama",
                        help="HF model dir ('' builds the tiny model in a temp dir)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--repeats", type=int, default=5, help="alternating timed pairs")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="timed runs on cuda (the checks run in float32)")
    parser.add_argument("--prompt-len", type=int, default=64,
                        help=f"--model {QWEN2_05B}: random prompt ids, half to all this long")
    parser.add_argument("--check-rows", type=int, default=8, help="cuda: rows checked")
    parser.add_argument("--check-tokens", type=int, default=32, help="cuda: tokens checked")
    parser.add_argument("--fp8", action="store_true",
                        help="cuda: also the engine with engine.dtype fp8 (graphs, compiled), "
                        "and each dtype's log-prob gap to a --dtype full forward")
    args = parser.parse_args()
    model_dir = build_model(args.model or None)
    if args.device == "cuda":
        sys.exit(0 if cuda_main(args, model_dir) else 1)
    print(f"model {model_dir}, {args.new_tokens} new tokens/request, {args.threads} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, medians of {args.repeats}")
    print(f"{'batch':>6} {'embedded tok/s':>15} {'HF generate tok/s':>18} {'HF thr':>6} "
          f"{'ratio':>7} {'cpu ratio':>9}  checks")
    failed = False
    for batch in args.batch_sizes:
        engine, hf, ratio, cpu_ratio, hf_count, error = bench_batch(
            model_dir, batch, args.new_tokens, args.threads, args.repeats
        )
        failed |= bool(error)
        checks = error or f"greedy == HF, log-probs within {LOGPROB_TOL:g} of a full forward"
        print(f"{batch:>6} {engine:>15.1f} {hf:>18.1f} {hf_count:>6} {ratio:>7.2f} "
              f"{cpu_ratio:>9.2f}  {checks}", flush=True)
    sys.exit(1 if failed else 0)


def _timed(run: Callable[[], list[Any]]) -> float:
    """Generated tokens per second of one call (its outputs are on the host: synced)."""
    start = time.perf_counter()
    tokens = sum(len(getattr(o, "output_ids", o)) for o in run())
    return tokens / (time.perf_counter() - start)


def cuda_main(args: argparse.Namespace, model_dir: str) -> bool:
    """Per batch size: the float32 checks, then the engine with and without CUDA graphs and
    HF generate (dynamic, static cache) alternately, `--repeats` rounds; medians."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engines.config.engine import EngineConfig
    from engines.inference.engine_actor import EngineActor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    random_len = args.prompt_len if args.model == QWEN2_05B else 0
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]

    def engine(dtype_name: str, eager: bool = False, compiled: bool = False,
               triton: bool = True) -> EngineActor:
        from engines.inference.kv_decode import TRITON_SWITCH

        os.environ[TRITON_SWITCH] = "1" if triton else "0"  # read as the decoder is made
        try:
            return EngineActor(EngineConfig(backend="embedded", model_path=model_dir,
                                            dtype=dtype_name, device="cuda",
                                            disable_cuda_graph=eager,
                                            enable_torch_compile=compiled), 0, 1)  # fmt: skip
        finally:
            os.environ.pop(TRITON_SWITCH)

    print(f"model {model_dir}, {torch.cuda.get_device_name()}, {args.dtype}, "
          f"{args.new_tokens} new tokens/request, medians of {args.repeats}")
    # (dtype, no graphs, compiled, Triton kernels): the default engine first; "no triton" is
    # its CUDA graph of the eager ops (`triton_decode`'s kernels off)
    variants = [(args.dtype, False, False, True), (args.dtype, False, False, False),
                (args.dtype, False, True, True), (args.dtype, True, False, True)]
    names = ["engine", "engine no triton", "engine compiled", "engine eager", "HF dynamic",
             "HF static"]
    if args.fp8:  # engine.dtype fp8, with CUDA graphs, then compiled as well
        variants += [("fp8", False, False, True), ("fp8", False, True, True)]
        names[4:4] = ["engine fp8", "engine fp8 compiled"]
    print(f"{'batch':>6} " + " ".join(f"{n + ' tok/s':>18}" for n in names) + "  checks")
    failed = False
    for batch in args.batch_sizes:
        ids = prompt_ids(tokenizer, batch, random_len)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
        actor = engine("float32")
        try:
            error = check_outputs(model, pad, ids[: args.check_rows], actor.url(),
                                  args.check_tokens)
        finally:
            actor.shutdown()
        model = model.to(dtype)
        actors = [engine(*variant) for variant in variants]
        try:
            if args.fp8:  # each engine dtype's log-probs against the trainer's (model's)
                for actor, (name, eager, compiled, triton) in zip(actors, variants, strict=True):
                    if not (eager or compiled) and triton:
                        mean, worst = logprob_gap(model, ids[: args.check_rows], actor.url(),
                                                  args.check_tokens)
                        print(f"{name} engine vs {args.dtype} forward: |log-prob diff| mean "
                              f"{mean:.4f}, max {worst:.4f}", flush=True)
            runners: list[Callable[[], list[Any]]] = [
                EngineRunner(a.url(), ids, args.new_tokens, 1.0) for a in actors]
            runners += [hf_runner(model, pad, ids, args.new_tokens, True, cache)
                        for cache in ("dynamic", "static")]
            for run in runners:
                run()  # warm-up (graph capture, torch.compile, HF's static cache)
            rates: list[list[float]] = [[] for _ in runners]
            for round_ in range(args.repeats):
                for run, out in zip(runners, rates, strict=True):
                    out.append(_timed(run))
                print(f"  round {round_ + 1}: " + " ".join(f"{r[-1]:.0f}" for r in rates),
                      flush=True)
        finally:
            for a in actors:
                a.shutdown()
        del model
        torch.cuda.empty_cache()
        failed |= bool(error)
        checks = error or (f"float32, {min(batch, args.check_rows)} rows x {args.check_tokens}: "
                           f"greedy == HF, log-probs within {LOGPROB_TOL:g} of a full forward")
        print(f"{batch:>6} " + " ".join(f"{statistics.median(r):>18.0f}" for r in rates)
              + f"  {checks}", flush=True)
    return not failed


if __name__ == "__main__":
    main()
