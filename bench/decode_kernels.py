"""The CUDA-graph decode step's Triton kernels (`engines/inference/triton_decode.py`) timed
against the eager ops they replace, at the Qwen2-0.5B shape and batch 256 (bf16), and the
attention kernel's block size, warps and pipeline stages swept. Each figure is the median of
`triton.testing.do_bench` (microseconds a call).

    python -m bench.decode_kernels [--rows 256] [--col 190]

Results: bench/RESULTS.md, "Embedded engine vs HF generate on a GPU".
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F


def main() -> None:
    import triton

    from engines.inference import triton_decode
    from engines.inference.kv_decode import _decode_attention, _rms_norm
    from engines.inference.sampling import SamplingRows, sample_tokens

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--col", type=int, default=190, help="the cache column written")
    parser.add_argument("--capacity", type=int, default=320)
    args = parser.parse_args()
    rows, col, capacity = args.rows, args.col, args.capacity
    heads, kv_heads, d, hidden, inter, vocab = 14, 2, 64, 896, 4864, 151_936
    bf = torch.bfloat16
    torch.manual_seed(0)

    def us(fn: object) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")) * 1e3

    x = torch.randn(rows, hidden, device="cuda", dtype=bf)
    w = torch.rand(hidden, device="cuda", dtype=bf)
    print(f"rms_norm: triton {us(lambda: triton_decode.rms_norm(x, w, 1e-6)):.1f} us, "
          f"eager {us(lambda: _rms_norm(x, w, 1e-6)):.1f}")
    gu = torch.randn(rows, 2 * inter, device="cuda", dtype=bf)
    print(f"silu_mul: triton {us(lambda: triton_decode.silu_mul(gu)):.1f} us, eager "
          f"{us(lambda: F.silu(gu[:, :inter].clone()).mul_(gu[:, inter:])):.1f}")

    kv = torch.randn(rows, kv_heads, 2, capacity, d, device="cuda", dtype=bf)
    mask = torch.ones(rows, capacity, dtype=torch.bool, device="cuda")
    mask[:, col + 1 :] = False
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, device="cuda", dtype=bf)
    positions = torch.full((rows,), col, device="cuda")
    rope = torch.randn(1024, 2, d, device="cuda", dtype=bf)
    colt = torch.tensor([col], device="cuda")
    q = qkv.view(rows, -1, 1, d)[:, :heads]
    keys, values = kv.unbind(2)
    bias = torch.where(mask[:, None, None, :], 0.0, float("-inf")).to(bf)
    print(f"attention (eager, every column of {capacity}): "
          f"{us(lambda: _decode_attention(q, keys, values, bias, 0.125)):.1f} us")
    for block, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
        def run(block: int = block, warps: int = warps, stages: int = stages) -> None:
            triton_decode.attention(qkv, kv, mask, colt, positions, rope, heads, kv_heads,
                                    0.125, block, warps, stages)
        try:
            print(f"attention triton block {block} warps {warps} stages {stages}: "
                  f"{us(run):.1f} us", flush=True)
        except Exception as err:  # noqa: BLE001 - a config that does not compile: next
            print(f"attention triton block {block} warps {warps} stages {stages}: {err!r}"[:200])

    logits = torch.randn(rows, vocab, device="cuda", dtype=bf)
    temps = torch.ones(rows, device="cuda")
    params = SamplingRows.of(temps, temps, torch.full((rows,), vocab, device="cuda"), vocab)
    u = torch.rand(rows, device="cuda")
    print(f"sample: triton {us(lambda: triton_decode.sample(logits, None, u, None)):.1f} us, "
          f"eager {us(lambda: sample_tokens(logits.float(), params, u)):.1f}")


if __name__ == "__main__":
    main()
