"""Sequence packing: the token slots each micro-batch layout computes, and what packing saves.

    python -m bench.packing                   # torch backend on the CPU, a small Qwen2 shape
    python -m bench.packing --layout-only --prompt-len 256 --response-len 768 --micro-tokens 16384
                                              # slots of bench.megatron_grpo's batch, no model

Layouts: `padded` (a row per sample, padded to the micro-batch's longest), `shared` (a row
per prompt with its responses, `train.share_prompts`), `packed` / `packed+shared`
(`train.pack_sequences`: rows as wide as the longest unit, block-diagonal mask) and
`varlen` (megatron with `pack_sequences`: one row of real tokens per micro-batch). Slots are
rows x width summed over one step's micro-batches (padding included): what the model runs
its matmuls on. Unless --layout-only, each torch layout trains `--steps` GRPO steps (after a
warm-up) from the same weights on one thread; CPU seconds per step are printed.

Results: bench/RESULTS.md, "Sequence packing".
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import time
from collections.abc import Callable, Sequence

import torch

from bench.grpo_batch import add_batch_arguments, make_samples
from engines.train.batching import PaddedBatch, build_padded_batch, split_micro_batches
from engines.train.packing import build_packed_batch
from engines.train.prompt_sharing import build_shared_prompt_batch
from storage.sample import Sample

Build = Callable[[Sequence[Sample], int], PaddedBatch]


def layouts(hidden: int) -> dict[str, tuple[Build, bool]]:
    """name: (batch builder, whether the budget counts real tokens); `hidden` picks the
    packed row width as the torch backend does (`packing.row_width`)."""
    pack = functools.partial(build_packed_batch, hidden_size=hidden)
    return {
        "padded": (build_padded_batch, False),
        "shared": (build_shared_prompt_batch, False),
        "packed": (functools.partial(pack, share_prompts=False), True),
        "packed+shared": (pack, True),
        "varlen": (functools.partial(build_packed_batch, varlen=True), True),
    }


TRAIN = {  # torch layouts: (share_prompts, pack_sequences)
    "padded": (False, False), "shared": (True, False),
    "packed": (False, True), "packed+shared": (True, True),
}


def layout_slots(
    samples: list[Sample], budget: int, layout: str, hidden: int
) -> tuple[int, int]:
    """(input token slots, micro-batches) of one step over `samples` in `layout`."""
    build, packed = layouts(hidden)[layout]
    share = layout in ("shared", "packed+shared")  # groups together, as step.micro_batches
    groups = [s.group_index for s in samples] if share else None
    split = split_micro_batches([len(s.tokens) for s in samples], budget, packed, groups)
    return sum(build([samples[i] for i in mb], 0).input_ids.numel() for mb in split), len(split)


def _model(path: str, vocab: int, hidden: int) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return path


def time_torch(path: str, samples: list[Sample], layout: str, args: argparse.Namespace) -> float:
    """CPU seconds per train() step of the torch backend in `layout` (one thread)."""
    from engines.train.torch_backend import TorchTrainBackend
    from flows.config.run import AlgorithmConfig, TrainConfig

    share, pack = TRAIN[layout]
    cfg = TrainConfig(model_path=path, lr=1e-5, device="cpu", seed=1, share_prompts=share,
                      pack_sequences=pack, max_tokens_per_micro_batch=args.micro_tokens)
    backend = TorchTrainBackend(cfg, AlgorithmConfig(), num_threads=1)
    backend.train(samples, 0)  # warm-up
    start = time.process_time()
    for k in range(args.steps):
        backend.train(samples, k + 1)
    return (time.process_time() - start) / args.steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    add_batch_arguments(ap, groups=4, prompt_len=32, response_len=160)
    ap.add_argument("--micro-tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256,
                    help="model width (896: Qwen2-0.5B); sets the packed row width")
    ap.add_argument("--layout-only", action="store_true")
    args = ap.parse_args()
    samples = make_samples(args.groups, args.group_size, args.prompt_len, args.response_len,
                           args.lengths)
    vocab = 4096
    for s in samples:  # make_samples draws from Qwen2's vocabulary (grpo_batch.VOCAB)
        s.tokens = [t % vocab for t in s.tokens]
    real = sum(len(s.tokens) for s in samples)
    print(f"{len(samples)} samples, {real} tokens (prompt {args.prompt_len}, responses "
          f"{args.lengths} up to {args.response_len}), budget {args.micro_tokens}", flush=True)
    with tempfile.TemporaryDirectory() as root:
        path = "" if args.layout_only else _model(os.path.join(root, "m"), vocab, args.hidden)
        base = None
        for layout in layouts(args.hidden):
            slots, mbs = layout_slots(samples, args.micro_tokens, layout, args.hidden)
            line = f"{layout:14s} slots {slots:8d} ({slots / real:5.2f}x real) micro-batches {mbs:3d}"
            if not args.layout_only and layout in TRAIN:
                sec = time_torch(path, samples, layout, args)
                base = base or sec
                line += f"  torch CPU {sec:7.2f} s/step ({sec / base:4.2f}x padded)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
