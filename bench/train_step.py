"""Training throughput of the torch backend: GRPO steps on random token batches.

Models: `tiny` (the arithmetic example's 2-layer Llama) and `qwen30m`, a ~30M-parameter
Qwen2-shaped model built from a config (random weights; the weights do not change speed).
Tokens/s counts prompt + response tokens of one `train()` call, which includes its no-grad
old-log-prob forward (the first global batch reuses its training forward). MFU (GPU only)
is 6 * N * tokens/s / peak dense bf16 (or fp32) FLOP/s of the GPU, N = all parameters.

    python -m bench.train_step --models tiny,qwen30m --steps 3
    python -m bench.train_step --device cuda --dtype bfloat16 --samples 64
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from engines.train.torch_backend import TorchTrainBackend
from flows.config.run import AlgorithmConfig, TrainConfig
from storage.sample import Sample

# Dense peak FLOP/s (no sparsity) by GPU name substring, (bf16, fp32-via-TF32).
PEAK_FLOPS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 494e12),
    "H100": (989e12, 494e12),
    "A100": (312e12, 156e12),
    "L40S": (362e12, 183e12),
    "A10": (125e12, 62.5e12),
}


def peak_flops(dtype: str) -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, (bf16, fp32) in PEAK_FLOPS.items():
        if key in name:
            return bf16 if dtype == "bfloat16" else fp32
    return None


def build_qwen30m(out_dir: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out_dir)
    return out_dir


def build_tiny(out_dir: str) -> str:
    from examples.arithmetic.build_model import save_tiny_model

    return save_tiny_model(out_dir, num_layers=2, hidden_size=64)


def make_samples(n: int, vocab: int, prompt: int, response: int) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tokens = torch.randint(4, vocab, (prompt + response,), generator=g).tolist()
        out.append(
            Sample(
                index=i,
                group_index=i // 8,
                tokens=tokens,
                response_length=response,
                loss_mask=[1] * response,
                reward=float(i % 3 == 0),
            )
        )
    return out


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a torch-backend step on `make_samples`' batch (this bench, bench.lora)."""
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--micro-tokens", type=int, default=16384)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)


def bench(name: str, path: str, args: argparse.Namespace) -> None:
    cfg = TrainConfig(
        model_path=path,
        lr=1e-5,
        dtype=args.dtype,
        device=args.device,
        global_batch_size=args.samples // 2,
        max_tokens_per_micro_batch=args.micro_tokens,
    )
    backend = TorchTrainBackend(cfg, AlgorithmConfig(), num_threads=args.threads)
    n_params = sum(p.numel() for p in backend.model.parameters())
    vocab = int(backend.model.config.vocab_size)
    samples = make_samples(args.samples, vocab, args.prompt_len, args.response_len)
    tokens = sum(len(s.tokens) for s in samples)
    backend.train(samples, 0)  # warm-up (allocator, kernels)
    sync = torch.cuda.synchronize if backend.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for k in range(args.steps):
        backend.train(samples, k + 1)
    sync()
    tps = tokens * args.steps / (time.perf_counter() - start)
    line = (
        f"{name:8s} params={n_params / 1e6:6.2f}M device={backend.device} dtype={args.dtype} "
        f"samples={args.samples}x{args.prompt_len + args.response_len} tokens/s={tps:,.0f}"
    )
    peak = peak_flops(args.dtype) if backend.device.type == "cuda" else None
    if peak:
        line += f" MFU={6 * n_params * tps / peak:.2%} ({torch.cuda.get_device_name()})"
    print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="tiny,qwen30m")
    add_step_arguments(parser)
    args = parser.parse_args()
    builders = {"tiny": build_tiny, "qwen30m": build_qwen30m}
    with tempfile.TemporaryDirectory() as root:
        for name in args.models.split(","):
            bench(name, builders[name](os.path.join(root, name)), args)


if __name__ == "__main__":
    main()
