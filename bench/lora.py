"""LoRA vs full fine-tuning on the torch backend: memory and step time on the same model.

Each mode runs in its own process (so peak RSS is that mode's), builds the backend with a
KL-loss GRPO setup (full fine-tuning then keeps a frozen reference copy; LoRA scores the
reference with its adapters disabled), takes one warm-up step and `--steps` timed steps on
the same random batch, and reports:

- params / trainable: all parameters of the policy, and those the optimizer holds;
- weights MB: the policy's parameters plus any reference copy (float32);
- grads + optim MB: gradient tensors and AdamW state (exp_avg, exp_avg_sq) after a step;
- peak RSS MB: the process's peak resident memory (includes ~the interpreter, torch and
  transformers: `base RSS` is measured before the model loads); GPU runs add peak CUDA MB;
- step s / cpu s: median wall and process CPU seconds of one `train()` call (CPU time is
  the steadier figure on a shared machine).

    python -m bench.lora                                  # qwen30m, full vs r=8 vs r=64
    python -m bench.lora --model qwen90m --modes full,8 --steps 3
    python -m bench.lora --device cuda --dtype bfloat16 --samples 64
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from bench.train_step import add_step_arguments, build_qwen30m, build_tiny, make_samples

ALGO = {"use_kl_loss": True, "kl_loss_coef": 0.01}


def build_qwen90m(out_dir: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out_dir)
    return out_dir


BUILDERS = {"tiny": build_tiny, "qwen30m": build_qwen30m, "qwen90m": build_qwen90m}


def _mb(tensors: Any) -> float:
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_one(mode: str, path: str, args: argparse.Namespace) -> dict[str, Any]:
    """One mode in this process: 'full' or a LoRA rank."""
    from engines.train.torch_backend import TorchTrainBackend
    from flows.config.run import AlgorithmConfig, TrainConfig

    base_rss = _rss_mb()
    lora = {} if mode == "full" else {"rank": int(mode), "alpha": 2 * int(mode)}
    cfg = TrainConfig.model_validate({
        "model_path": path, "lr": 1e-5, "dtype": args.dtype, "device": args.device,
        "global_batch_size": args.samples // 2, "max_tokens_per_micro_batch": args.micro_tokens,
        "lora": lora,
    })
    backend = TorchTrainBackend(cfg, AlgorithmConfig.model_validate(ALGO), num_threads=args.threads)
    vocab = int(backend.model.config.vocab_size)
    samples = make_samples(args.samples, vocab, args.prompt_len, args.response_len)
    cuda = backend.device.type == "cuda"
    backend.train(samples, 0)  # warm-up: optimizer state exists from here on
    walls, cpus = [], []
    for k in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter(), time.process_time()
        backend.train(samples, k + 1)
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    params = list(backend.model.parameters())
    ref = list(backend.ref_model.parameters()) if backend.ref_model is not None else []
    optim = [v for state in backend.actor.optimizer.state.values()
             for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "mode": "full" if mode == "full" else f"lora r={mode}",
        "params": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for g in backend.actor.optimizer.param_groups
                         for p in g["params"]),
        "weights_mb": _mb(params + ref),
        "grads_optim_mb": _mb([p.grad for p in params if p.grad is not None] + optim),
        "base_rss_mb": base_rss,
        "peak_rss_mb": _rss_mb(),
        "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "step_s": statistics.median(walls),
        "cpu_s": statistics.median(cpus),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'mode':12s} {'params':>9s} {'trainable':>10s} {'weights MB':>11s} "
            f"{'grads+optim MB':>15s} {'base RSS MB':>12s} {'peak RSS MB':>12s} "
            f"{'step s':>7s} {'cpu s':>7s}")
    cuda = any(r["peak_cuda_mb"] is not None for r in rows)
    lines = [head + (f" {'peak CUDA MB':>13s}" if cuda else "")]
    for r in rows:
        line = (f"{r['mode']:12s} {r['params'] / 1e6:8.2f}M {r['trainable'] / 1e6:9.3f}M "
                f"{r['weights_mb']:11.1f} {r['grads_optim_mb']:15.1f} {r['base_rss_mb']:12.0f} "
                f"{r['peak_rss_mb']:12.0f} {r['step_s']:7.2f} {r['cpu_s']:7.2f}")
        lines.append(line + (f" {r['peak_cuda_mb']:13.0f}" if cuda else ""))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen30m", choices=sorted(BUILDERS))
    parser.add_argument("--modes", default="full,8,64", help="'full' and/or LoRA ranks")
    add_step_arguments(parser)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one mode, print JSON
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args.path, args)), flush=True)
        return
    passthrough = [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
                   if value is not None and key not in ("one", "path")]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        path = BUILDERS[args.model](os.path.join(root, args.model))
        for mode in args.modes.split(","):
            out = subprocess.run(
                [sys.executable, "-m", "bench.lora", *passthrough, "--one", mode, "--path", path],
                check=True, capture_output=True, text=True,
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(f"done: {rows[-1]['mode']}", file=sys.stderr, flush=True)
    print(f"model={args.model} device={args.device} dtype={args.dtype} "
          f"samples={args.samples}x{args.prompt_len + args.response_len} algorithm=GRPO+KL loss")
    print(table(rows))


if __name__ == "__main__":
    main()
