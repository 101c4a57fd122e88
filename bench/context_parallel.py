"""Context parallelism (`train.context_parallel`) on one long sequence of the 0.5B Qwen2 shape:
per-rank peak memory and time of a forward and backward of the policy loss, unsplit (rank 0
alone) and split across all ranks, and how far the split log-probs and loss are from the
unsplit ones.

    python -m bench.context_parallel --lengths 32768,65536 --dtype bfloat16
    python -m bench.context_parallel --lengths 32768 --dtype float32 --world 2

Ranks: one per GPU (NCCL) when there are enough GPUs; otherwise all ranks share GPU 0 (or
the CPU) through gloo: the kernels and each rank's memory are what they would be, the
transport is slower. The model is randomly initialised (`--layers` of the 0.5B shape,
activation checkpointing on unless `--no-activation-checkpointing`); the sequence is a
`--prompt-len` prompt and a response filling the rest. Prints one JSON line per length; an
unsplit step that runs out of memory says so instead of a figure; `--memory-gib 80` caps each
rank at an H100's memory on a larger card. Results:
bench/RESULTS.md, "Context parallelism".
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.megatron_grpo import QWEN2_05B
from engines.train.batching import PaddedBatch, build_padded_batch
from engines.train.context_parallel import ContextGroup, use_context_parallel
from engines.train.torch_models import autocast, checkpoint_activations, response_outputs
from storage.sample import Sample

GIB = 2**30


def placement(rank: int, world: int) -> tuple[torch.device, str]:
    """This rank's device and the group's backend (see the module docstring)."""
    if torch.cuda.device_count() >= world:
        return torch.device("cuda", rank), "nccl"
    if torch.cuda.is_available():
        return torch.device("cuda", 0), "gloo"
    return torch.device("cpu"), "gloo"


def build_model(layers: int, max_length: int, device: torch.device) -> torch.nn.Module:
    """The 0.5B shape with `layers` layers, the same random weights on every rank."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    shape = {**QWEN2_05B, "num_hidden_layers": layers, "max_position_embeddings": max_length}
    model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=torch.float32)
    return torch.nn.Module.to(model, device).eval()


def long_batch(length: int, prompt_len: int, vocab: int) -> PaddedBatch:
    g = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, vocab, (length,), generator=g).tolist()
    response = length - prompt_len
    sample = Sample(index=0, group_index=0, tokens=tokens, response_length=response,
                    loss_mask=[1] * response)
    return build_padded_batch([sample], 0)


def loss_step(model: torch.nn.Module, batch: PaddedBatch, dtype: torch.dtype,
              context: ContextGroup | None, chunked_head: bool = False) -> dict[str, Any]:
    """Forward and backward of the mean response log-prob; its time, this process's peak
    memory, the loss and the log-probs (or `oom`)."""
    device = batch.input_ids.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    try:
        with autocast(device, dtype):
            log_probs, _, _ = response_outputs(model, batch, 1.0, context=context,
                                               chunked_head=chunked_head)
        loss = -(log_probs * batch.loss_mask).sum() / batch.loss_mask.sum()
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
    except torch.OutOfMemoryError as exc:
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()
        return {"oom": str(exc).split(". ")[0]}
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated(device) / GIB if cuda else None
    result = {"time_s": seconds, "peak_gib": peak, "loss": float(loss.detach()),
              "log_probs": log_probs.detach().float().cpu()}
    if cuda:  # ranks sharing one GPU: what this step cached is the next one's room
        del log_probs, loss
        torch.cuda.empty_cache()
    return result


def _rank(rank: int, world: int, init: str, args: dict[str, Any], out: str) -> None:
    device, backend = placement(rank, world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if args["memory_gib"]:  # a smaller card: an H100's 80 GB on an H200
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args["memory_gib"] * GIB / total),
                                                       device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=1800))
    try:
        lengths = args["lengths"]
        dtype = getattr(torch, args["dtype"])
        model = build_model(args["layers"], max(lengths), device)
        if args["activation_checkpointing"]:
            checkpoint_activations(model)
        use_context_parallel(model)  # unsplit forwards (context None) still run sdpa
        group = ContextGroup.build(world)
        vocab = model.config.vocab_size
        warm = long_batch(2048, 256, vocab).to(device)
        loss_step(model, warm, dtype, None)
        loss_step(model, warm, dtype, group)
        rows = []
        for length in lengths:
            batch = long_batch(length, args["prompt_len"], vocab).to(device)
            chunked = args["chunked_lm_head"]
            single = loss_step(model, batch, dtype, None, chunked) if rank == 0 else {}
            dist.barrier()
            split = loss_step(model, batch, dtype, group, chunked)
            rows.append({"length": length, "single": single, "split": split})
            print(f"rank {rank}: {length} tokens done", flush=True)
        torch.save(rows, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def report(rows: list[list[dict[str, Any]]], world: int, args: argparse.Namespace) -> None:
    """One JSON line per length from every rank's rows."""
    for per_rank in zip(*rows, strict=True):
        single, splits = per_rank[0]["single"], [r["split"] for r in per_rank]
        line: dict[str, Any] = {
            "length": per_rank[0]["length"], "context_parallel": world, "dtype": args.dtype,
            "layers": args.layers, "activation_checkpointing": args.activation_checkpointing,
            "memory_cap_gib": args.memory_gib or None, "chunked_lm_head": args.chunked_lm_head,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "gpus": torch.cuda.device_count(),
        }
        if any(s.get("oom") for s in splits):
            line["split"] = next(s["oom"] for s in splits if s.get("oom"))
        else:
            line["split_peak_gib_per_rank"] = [round(s["peak_gib"], 2) for s in splits
                                               if s["peak_gib"] is not None]
            line["split_time_s"] = round(max(s["time_s"] for s in splits), 3)
        if single.get("oom"):
            line["unsplit"] = single["oom"]
        else:
            if single["peak_gib"] is not None:
                line["unsplit_peak_gib"] = round(single["peak_gib"], 2)
            line["unsplit_time_s"] = round(single["time_s"], 3)
            if "split" not in line:
                ref = single["log_probs"]
                line["max_abs_log_prob_diff"] = max(
                    float((s["log_probs"] - ref).abs().max()) for s in splits)
                line["loss_diff"] = max(abs(s["loss"] - single["loss"]) for s in splits)
        print(json.dumps(line), flush=True)


def run(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        mp.spawn(_rank, args=(args.world, init, vars(args), tmp), nprocs=args.world)
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(args.world)]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="32768",
                        type=lambda s: [int(x) for x in s.split(",")],
                        help="comma-separated sequence lengths")
    parser.add_argument("--world", type=int, default=2, help="ranks (context_parallel)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--layers", type=int, default=QWEN2_05B["num_hidden_layers"])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--memory-gib", type=float, default=0.0,
                        help="cap each rank's GPU memory (80: an H100 on a larger card)")
    parser.add_argument("--chunked-lm-head", action="store_true",
                        help="train.chunked_lm_head: the LM head a chunk of tokens at a time")
    parser.add_argument("--no-activation-checkpointing", dest="activation_checkpointing",
                        action="store_false")
    return parser.parse_args(argv)


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse()
    report(run(args), args.world, args)


if __name__ == "__main__":
    main()
