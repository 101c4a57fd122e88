"""GRPO steps on a randomly initialised Qwen2-shaped ~0.5B model (or, `--family qwen3_moe`, a
Qwen3-MoE of 2B parameters with 0.3B active outside the embeddings), torch vs megatron.

    python -m bench.megatron_grpo --backend torch
    python -m bench.megatron_grpo --backend megatron [--pack]        # --pack: pack_sequences
    torchrun --nproc-per-node 2 -m bench.megatron_grpo --backend megatron --tp 2
    python -m bench.megatron_grpo --backend all     # each of the above (TP=2 if 2 GPUs)
    python -m bench.megatron_grpo --backend megatron --prompt-len 1024 --response-len 3072 --profile
    python -m bench.megatron_grpo --backend megatron --lengths longtail [--pack]   # RL-like lengths
    python -m bench.megatron_grpo --backend megatron --family qwen3_moe
    torchrun --nproc-per-node 1 -m bench.megatron_grpo --backend torch --strategy fsdp2 \
        [--activation-checkpointing] [--fsdp-cpu-offload]   # torch: FSDP2 (also on one GPU)
        [--chunked-lm-head]                                 # torch: train.chunked_lm_head
    python -m bench.megatron_grpo --backend torch [--flash-attention on|off] [--compile-layers]
    torchrun --nproc-per-node 2 -m bench.megatron_grpo --backend megatron --family qwen3_moe --ep 2

Prints one JSON line per run: training tokens/s (prompt + response tokens of the batch per
`train()` second, steps after the first), MFU, the input token slots the step's
micro-batches ran (padding included; `bench.packing` layouts), the share of the padded
layout's slots that are padding (`padded_share`, whichever layout ran) and step-0 `ppo_kl`
(reported as `approx_kl`; on-policy it must be ~0). `--profile` adds the top CUDA ops of one
more step.

MFU counts the model FLOPs of the tokens the backend needs to compute (`step_flops`): 6N per
token plus 12·h per attended query/key pair and layer (forward + backward), N the
non-embedding matmul parameters, plus 6H per response token for the LM head H (both
backends project the response positions only), N counting for an MoE model the attention,
the router and the experts a token is routed to (its active parameters); a prompt shared by its group's responses
(the torch backend's `share_prompts`) once; padding never; and the no-grad old-log-prob
forward only where the step runs it (the step takes the old log-probs from the first
training forward on one DP rank and one stage).

Packing can only pay where padding is large: the default `--lengths half` gives padded
micro-batches of similar lengths, `--lengths longtail` many short responses and a few long
ones. Results: bench/RESULTS.md, "Megatron GRPO".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from bench.grpo_batch import VOCAB, add_batch_arguments, make_samples
from bench.packing import layout_slots
from flows.config.run import AlgorithmConfig, TrainConfig
from storage.sample import Sample

QWEN2_05B = dict(
    vocab_size=VOCAB, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
    tie_word_embeddings=True,
)
# Qwen3-30B-A3B's layer (hidden 2048, 32 heads of 128, 4 KV heads, experts of 768) with 8
# layers of 32 experts, 4 per token: one H100 holds it with Adam's state.
QWEN3_MOE_2B = dict(
    vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, moe_intermediate_size=768,
    num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, router_aux_loss_coef=0.0,
    max_position_embeddings=4096, tie_word_embeddings=False,
)
SHAPES: dict[str, dict[str, Any]] = {"qwen2": QWEN2_05B, "qwen3_moe": QWEN3_MOE_2B}


def make_model(path: str, family: str = "qwen2") -> int:
    """Save a random model of `family`'s shape (bf16); returns its parameter count."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    config = {"qwen2": Qwen2Config, "qwen3_moe": Qwen3MoeConfig}[family](**SHAPES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def _dims(family: str = "qwen2") -> tuple[int, int, int, int]:
    """(hidden, layers, N, H): N = the non-embedding matmul parameters a token runs through
    (an MoE layer's router and its top-k experts, not the others), H = the LM head's."""
    c = SHAPES[family]
    h, layers, v = (int(c[k]) for k in ("hidden_size", "num_hidden_layers", "vocab_size"))
    heads = int(c["num_attention_heads"])
    d = int(c.get("head_dim") or h // heads)
    attn = h * d * (2 * heads + 2 * int(c["num_key_value_heads"]))  # q, o; k, v
    if "num_experts" in c:
        mlp = h * int(c["num_experts"]) + 3 * h * int(c["moe_intermediate_size"]) * int(
            c["num_experts_per_tok"])
    else:
        mlp = 3 * h * int(c["intermediate_size"])
    return h, layers, layers * (attn + mlp), h * v


def step_flops(
    samples: list[Sample], shared_prompts: bool, old_forward: bool, family: str = "qwen2"
) -> tuple[float, int]:
    """(model FLOPs, tokens computed) of one `train()` over `samples`: forward + backward
    (6N per token, 12·h per attended query/key pair and layer) of the tokens the backend
    computes (a shared prompt once per group), the LM head (6H) at the response positions
    only (both backends project only those), plus a forward (a third of that) for the old
    log-probs where the step runs one (`lazy_old_log_probs` is False). Padding is not counted."""
    h, layers, n, head = _dims(family)
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    tokens, pairs = 0, 0.0
    for members in groups.values():
        p = members[0].prompt_length
        share = shared_prompts and len(members) > 1
        tokens += p if share else 0
        pairs += p * p / 2 if share else 0.0
        for s in members:
            r = s.response_length
            tokens += r if share else p + r
            pairs += r * p + r * r / 2 if share else (p + r) ** 2 / 2
    responses = sum(s.response_length for s in samples)
    flops = 6 * n * tokens + 6 * head * responses + 12 * h * layers * pairs
    return flops * (4 / 3 if old_forward else 1.0), tokens


def run_all(argv: list[str]) -> None:
    """Each configuration in a fresh process (megatron's groups and memory are per process):
    torch, megatron TP=1 and, with two GPUs or more, megatron TP=2 under torchrun."""
    rest = [a for a in argv if a not in ("--backend", "all")]
    runs = [["--backend", "torch"], ["--backend", "megatron"]]
    prefix = [[sys.executable, "-m", "bench.megatron_grpo"]] * 2
    if torch.cuda.device_count() >= 2:
        runs.append(["--backend", "megatron", "--tp", "2"])
        prefix.append([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc-per-node=2", "-m", "bench.megatron_grpo"])
    for pre, run in zip(prefix, runs, strict=True):
        subprocess.run([*pre, *run, *rest], check=True)


def main() -> None:
    if "all" in sys.argv[1:]:
        run_all(sys.argv[1:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=["torch", "megatron", "all"], required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="megatron: expert parallel (qwen3_moe)")
    ap.add_argument("--family", choices=sorted(SHAPES), default="qwen2")
    ap.add_argument("--steps", type=int, default=3)
    add_batch_arguments(ap, groups=8, prompt_len=256, response_len=768)
    ap.add_argument("--micro-tokens", type=int, default=16384)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 per GPU")
    ap.add_argument("--pack", action="store_true", help="train.pack_sequences")
    ap.add_argument("--share", choices=["auto", "on", "off"], default="auto",
                    help="train.share_prompts (torch; auto: on the CPU only)")
    ap.add_argument("--profile", action="store_true",
                    help="one more step under torch.profiler: the top CUDA kernels")
    ap.add_argument("--strategy", choices=["ddp", "fsdp2"], default="ddp",
                    help="torch: train.strategy (fsdp2 shards even on one GPU: a group of one)")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="torch: train.activation_checkpointing")
    ap.add_argument("--fsdp-cpu-offload", action="store_true", help="torch: train.fsdp_cpu_offload")
    ap.add_argument("--chunked-lm-head", action="store_true", help="torch: train.chunked_lm_head")
    ap.add_argument("--flash-attention", choices=["auto", "on", "off"], default="auto",
                    help="torch: train.flash_attention (auto: on a GPU)")
    ap.add_argument("--compile-layers", action="store_true", help="torch: train.compile_layers")
    ap.add_argument("--model-dir", default=None,
                    help="default: a random model of --family's shape in the temp directory")
    args = ap.parse_args()
    args.model_dir = args.model_dir or os.path.join(
        tempfile.gettempdir(), {"qwen2": "qwen2-05b-random", "qwen3_moe": "qwen3-moe-2b-random"}[args.family])

    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if rank == 0 and not os.path.exists(os.path.join(args.model_dir, "config.json")):
        make_model(args.model_dir, args.family)
    if world > 1 or args.strategy == "fsdp2":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.distributed.init_process_group("nccl")
        torch.distributed.barrier()
    train_cfg = TrainConfig(model_path=args.model_dir, lr=1e-6, dtype="bfloat16",
                            max_tokens_per_micro_batch=args.micro_tokens, seed=1,
                            pack_sequences=args.pack, share_prompts={"auto": None, "on": True, "off": False}[args.share],
                            strategy=args.strategy, fsdp_cpu_offload=args.fsdp_cpu_offload,
                            activation_checkpointing=args.activation_checkpointing,
                            chunked_lm_head=args.chunked_lm_head,
                            flash_attention={"auto": None, "on": True, "off": False}[
                                args.flash_attention],
                            compile_layers=args.compile_layers)
    algo = AlgorithmConfig()
    backend: Any
    if args.backend == "torch":
        from engines.train.torch_backend import TorchTrainBackend

        backend = TorchTrainBackend(train_cfg, algo)  # train.device="auto": this GPU
    else:
        from engines.train.megatron import MegatronTrainBackend

        backend = MegatronTrainBackend(train_cfg, algo, tensor_parallel=args.tp,
                                       expert_parallel=args.ep)
    samples = make_samples(args.groups, args.group_size, args.prompt_len, args.response_len,
                           args.lengths)
    tokens = sum(len(s.tokens) for s in samples)
    hidden = _dims(args.family)[0]
    padded_slots = layout_slots(samples, args.micro_tokens, "padded", hidden)[0]
    runs = [backend.train(samples, step) for step in range(args.steps)]
    timed = runs[1:] or runs
    tok_s = sum(r["train_tokens_per_s"] for r in timed) / len(timed)
    shared = backend.shares_prompts
    flops, computed = step_flops(samples, shared, not backend.lazy_old_log_probs, args.family)
    layout = {(False, False): "padded", (True, False): "shared", (False, True): "packed",
              (True, True): "packed+shared"}[(shared, args.pack)]
    if args.backend == "megatron" and args.pack:
        layout = "varlen"
    mfu = flops * tok_s / tokens / (args.peak_tflops * 1e12 * world)
    if rank == 0:
        print(json.dumps({
            "backend": args.backend, "family": args.family, "tp": args.tp, "ep": args.ep,
            "strategy": args.strategy, "activation_checkpointing": args.activation_checkpointing,
            "fsdp_cpu_offload": args.fsdp_cpu_offload, "chunked_lm_head": args.chunked_lm_head,
            "flash_attention": args.flash_attention, "compile_layers": args.compile_layers,
            "gpus": world, "samples": len(samples),
            "seq": args.prompt_len + args.response_len, "lengths": args.lengths,
            "pack": args.pack, "layout": layout, "tokens_per_step": tokens,
            "tokens_computed": computed,
            "input_slots": layout_slots(samples, args.micro_tokens, layout, hidden)[0],
            "padded_share": round(1 - tokens / padded_slots, 4),
            "tokens_per_s": round(tok_s, 1), "mfu": round(mfu, 4),
            "step_s": round(tokens / tok_s, 3),
            "step0_ppo_kl": runs[0]["approx_kl"], "step0_clipfrac": runs[0]["clipfrac"],
            "losses": [round(r["loss"], 5) for r in runs],
            "max_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
            if torch.cuda.is_available() else None,
        }), flush=True)
    if args.profile:
        profile_step(backend, samples, args.steps, rank)


def profile_step(backend: Any, samples: list[Sample], step: int, rank: int) -> None:
    """One more `train()` under torch.profiler; rank 0 prints the top 30 ops by self time
    on the GPU (on the CPU where there is none)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        start = time.perf_counter()
        backend.train(samples, step)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    if rank == 0:
        print(f"profiled step: {wall:.3f} s wall", flush=True)
        key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60),
              flush=True)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15,
                                        max_name_column_width=60), flush=True)
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by=key, row_limit=40, max_name_column_width=40, max_shapes_column_width=80),
            flush=True)

if __name__ == "__main__":
    main()
