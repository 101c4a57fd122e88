"""The whole system through the real `train` flow: a local Ray head that
sees the machine's GPUs, Prefect (ephemeral), the embedded engine and the trainer each on
their placement-group bundle, weights over `train.weight_sync`. `scripts/gpu/e2e.sh` runs the
parts on a 2-GPU machine; each also runs on a CPU (`--quick`, gloo instead of NCCL).

    python scripts/gpu/e2e.py arithmetic [--backend torch|megatron]   # (a) SFT, then GRPO
    python scripts/gpu/e2e.py arithmetic --family qwen3_moe --backend megatron \
        --set train.expert_parallel=2 ...                              # (e) the same, MoE
    python scripts/gpu/e2e.py qwen [--colocate]                       # (b), (c)
    python scripts/gpu/e2e.py qwen --backend megatron --run-name ... \
        --set train.tensor_parallel=2 --set engine.num_engines=2 ...    # (f)

Everything printed comes from what the flow stored: each step's metrics.json (the per-task
seconds `time/<task>`, tokens/s, weight-sync seconds), train.arrow (tokens per sample, for
MFU) and the held-out evaluations. MFU counts FLOPs as bench/megatron_grpo.py does (old
log-prob forward + forward/backward) against --peak-tflops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TASKS = ("sample_prompts", "generate", "filter", "reward", "train", "broadcast_weights", "commit")
ARITH = REPO / "examples" / "arithmetic"


def step_rows(run_dir: str) -> list[dict[str, Any]]:
    """Each committed step's metrics, plus the mean tokens per trained sample."""
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = []
    for step in sorted(Path(run_dir, "steps").iterdir()):
        if not (step / "COMMITTED").exists():
            continue
        m = json.loads((step / "metrics.json").read_text())
        table = pa.ipc.open_file(str(step / "train.arrow")).read_all()
        m["tokens_per_sample"] = pc.mean(pc.list_value_length(table["tokens"])).as_py()
        rows.append(m)
    return rows


def flops_per_token(model_dir: str, seq: float) -> float:
    """bench.megatron_grpo's count for any Llama/Qwen2/Qwen3(-MoE) config: 8N + 8·L·h·s per
    token (old log-prob forward 2N + 2·attn, forward + backward 6N + 6·attn), N the
    parameters a token runs through (an MoE layer's router and top-k experts only)."""
    c = json.loads(Path(model_dir, "config.json").read_text())
    h, layers, v, heads = (c[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                          "num_attention_heads"))
    d = c.get("head_dim") or h // heads
    attn_params = h * d * (2 * heads + 2 * c.get("num_key_value_heads", heads))
    experts = c.get("num_experts") or c.get("num_local_experts")
    mlp = (h * experts + 3 * h * c["moe_intermediate_size"] * c["num_experts_per_tok"]
           if experts else 3 * h * c["intermediate_size"])
    n = layers * (attn_params + mlp) + h * v
    attn = layers * h * seq
    return 8 * n + 8 * attn


def task_sum(m: dict[str, Any]) -> float:
    return sum(m.get(f"time/{t}", 0.0) for t in TASKS)


def print_table(title: str, rows: list[dict[str, Any]], model_dir: str, peak_tflops: float,
                gpus: int = 1) -> dict[str, Any]:
    """The per-task time table and the run's weight-sync seconds, tok/s and MFU (over the
    trainer's `gpus`). Train tok/s and MFU count the tokens the optimizer steps computed
    (`train/trained_tokens`; zero-gradient samples excluded): a step that trained none has
    neither, and shows '-'."""
    print(f"\n=== {title}: seconds per task, per step (from steps/*/metrics.json) ===")
    head = ["step", "prompts", "generate", "filter", "reward", "train", "w-sync", "commit",
            "sum", "gen tok", "gen tok/s", "trn tok", "trn tok/s", "MFU"]
    print(" | ".join(f"{h:>9}" for h in head))

    def mfu(m: dict[str, Any]) -> float | None:  # None for a step that trained nothing
        if not m.get("train/trained_tokens"):
            return None
        return m.get("train/train_tokens_per_s", 0.0) * flops_per_token(
            model_dir, m["tokens_per_sample"]) / (peak_tflops * 1e12 * gpus)

    for m in rows:
        tokens = m.get("train/trained_tokens", 0.0)
        cells = [m["rollout_id"], *(m.get(f"time/{t}", 0.0) for t in TASKS),
                 task_sum(m), m.get("rollout/generated_tokens", 0),
                 m.get("rollout/tokens_per_s", 0.0), int(tokens),
                 m.get("train/train_tokens_per_s", 0.0) if tokens else None, mfu(m)]
        print(" | ".join("        -" if c is None else f"{c:>9.4g}" if isinstance(c, float)
                         else f"{c:>9}" for c in cells))
    later = rows[1:] or rows  # step 0 includes warm-up (CUDA init, allocator growth)
    trained = [m for m in rows if m.get("train/trained_tokens")]
    steady = [m for m in trained if m is not rows[0]] or trained

    def mean(values: list[float], digits: int) -> float | None:
        return round(sum(values) / len(values), digits) if values else None

    summary = {
        "part": title, "steps": len(rows),
        "weight_sync_s": [round(m.get("broadcast_weights/seconds", 0.0), 3) for m in rows],
        "gen_tokens_per_s": mean([m.get("rollout/tokens_per_s", 0.0) for m in later], 1),
        "trained_tokens": [int(m.get("train/trained_tokens", 0.0)) for m in rows],
        "train_tokens_per_s": mean([m.get("train/train_tokens_per_s", 0.0) for m in steady], 1),
        "mfu": mean([mfu(m) or 0.0 for m in steady], 4),
        "step_s": round(sum(task_sum(m) for m in later) / max(len(later), 1), 2),
        "reward_mean": [round(m.get("reward/mean", 0.0), 3) for m in rows],
        # the engine's log-probs vs the trainer's recomputation of the same tokens
        "logprob_abs_diff": [round(m.get("train/rollout_logprob_abs_diff", 0.0), 5) for m in rows],
    }
    print("summary " + json.dumps(summary))
    print_push(rows)
    return summary


PUSH = ("connect_s", "pause_s", "export_s", "to_device_s", "first_broadcast_s", "broadcast_s",
        "engines_s", "flush_s", "continue_s", "versions_s", "total_s")


def print_push(rows: list[dict[str, Any]]) -> None:
    """Where each step's weight push over HTTP spent its seconds (`broadcast_weights/push/*`,
    the trainer's sender: connect_s is the group set-up, at the first push only; export_s the
    (collective) export; first_broadcast_s the first bucket's broadcast, which also sets up
    NCCL's communicator; engines_s the engines' answers after the broadcasts), next to the
    task's own seconds (w-sync), and the engines the step had and updated."""
    if not any(k.startswith("broadcast_weights/push/") for m in rows for k in m):
        return
    print("\n=== weight push per step, seconds (broadcast_weights/push/*) ===")
    short = {"first_broadcast_s": "1st-bcast", "to_device_s": "to-device"}
    head = ["step", "w-sync", *(short.get(k, k.removesuffix("_s")) for k in PUSH), "buckets",
            "MB", "n-engines", "updated"]
    print(" | ".join(f"{h:>9}" for h in head))
    for m in rows:
        push = {k: m.get(f"broadcast_weights/push/{k}") for k in (*PUSH, "buckets", "bytes")}
        cells = [m["rollout_id"], m.get("time/broadcast_weights", 0.0), *(push[k] for k in PUSH),
                 None if push["buckets"] is None else int(push["buckets"]),
                 None if push["bytes"] is None else push["bytes"] / 1e6,
                 int(m.get("rollout/engines", 0)), int(m.get("broadcast_weights/engines_updated", 0))]
        print(" | ".join("        -" if c is None else f"{c:>9.4g}" if isinstance(c, float)
                         else f"{c:>9}" for c in cells))
    first = {k: round(v, 3) for k in PUSH
             if (v := rows[0].get(f"broadcast_weights/push/{k}")) is not None}
    print("first push " + json.dumps({"step": rows[0]["rollout_id"],
                                      "w_sync_s": round(rows[0].get("time/broadcast_weights", 0.0), 3),
                                      **first}))


def load(name: str, overrides: list[str]) -> Any:
    from flows.config.loader import load_config

    return load_config(ARITH / f"{name}.yaml", overrides)


def arithmetic(args: argparse.Namespace) -> None:
    """(a) The main job (scripts/main.sh's steps: SFT warm start, then GRPO), placed on GPUs
    by the local head; the GRPO phase syncs weights over `--weight-sync`."""
    from examples.arithmetic.build_model import save_tiny_model
    from examples.arithmetic.make_data import write_datasets
    from flows.train import train

    art = Path(args.work, "arithmetic")
    data = write_datasets(str(art / "data"), n_train=4000, n_test=500, n_sft=1000)
    llama = args.family == "llama"
    model = save_tiny_model(str(art / ("tiny-llama" if llama else f"tiny-{args.family}")),
                            family=args.family)
    runs = str(Path(args.work, "runs"))
    common = [f"storage.uri={runs}",
              f"eval.datasets=[{{name: test, path: {data['test']}, temperature: 0.0}}]"]
    quick = ["rollout.num_rollout=2", "rollout.rollout_batch_size=32"] if args.quick else []
    sft_run = "arithmetic-sft" if llama else f"arithmetic-sft-{args.family}"
    sft_ckpt = Path(runs, sft_run, "checkpoints")
    sft_steps = args.sft_rollouts or (2 if args.quick else None)
    t0 = time.perf_counter()
    if args.backend == "torch" or not sft_ckpt.exists():
        sft = load("sft", [*common, f"data.prompt_data={data['sft']}", f"train.model_path={model}",
                           f"storage.run_name={sft_run}",
                           *([f"rollout.num_rollout={sft_steps}"] if sft_steps else [])])
        res = train(sft)
        print(f"SFT: {res['run_dir']} ({time.perf_counter() - t0:.1f} s)")
    last = sorted(p.name for p in sft_ckpt.iterdir() if p.name.isdigit())[-1]
    run_name = "arithmetic-grpo" if args.backend == "torch" else f"arithmetic-grpo-{args.backend}"
    run_name += "" if llama else f"-{args.family}"
    grpo = load("grpo", [*common, f"data.prompt_data={data['train']}",
                         f"train.model_path={sft_ckpt / last}", f"storage.run_name={run_name}",
                         f"train.backend={args.backend}", f"train.weight_sync={args.weight_sync}",
                         *quick, *args.set])
    t1 = time.perf_counter()
    res = train(grpo)
    seconds = time.perf_counter() - t1
    before, after = (100.0 * res["evals"][v]["eval/test"] for v in (0, grpo.rollout.num_rollout))
    rows = step_rows(res["run_dir"])
    gpus = grpo.cluster.train_ranks
    summary = print_table(f"arithmetic GRPO ({args.backend} trainer, {args.family})", rows,
                          model, args.peak_tflops, gpus)
    print(f"held-out exact match ({args.backend}): before RL {before:.1f}%, after RL {after:.1f}% "
          f"({after - before:+.1f} points); GRPO {seconds:.1f} s, {grpo.rollout.num_rollout} steps")
    print(f"resumed at step {res['resumed_at']}, trainer: {res['restored']}")
    print("result " + json.dumps({**summary, "acc_before": before, "acc_after": after,
                                  "grpo_s": round(seconds, 1)}))


def save_qwen2_shaped(path: Path, quick: bool) -> str:
    """A random Qwen2-0.5B-shaped model (bench.megatron_grpo's shape; `quick`: 2 narrow
    layers) with the example's character tokenizer: prompts are arithmetic text, and the
    token ids it samples beyond the tokenizer's vocabulary decode to nothing."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.megatron_grpo import QWEN2_05B
    from examples.arithmetic.build_model import build_tokenizer

    if (path / "config.json").exists():
        return str(path)
    tok = build_tokenizer()
    shape = dict(QWEN2_05B)
    if quick:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    cfg = Qwen2Config(**shape, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return str(path)


def qwen(args: argparse.Namespace) -> None:
    """(b) GRPO on a Qwen2-0.5B-shaped model, trainer and engine on their own GPUs;
    (c) `--colocate`: both on one GPU, offloading between phases."""
    from examples.arithmetic.make_data import write_datasets
    from flows.train import train

    art = Path(args.work, "arithmetic")
    data = write_datasets(str(art / "data"), n_train=4000, n_test=500, n_sft=1000)
    model = save_qwen2_shaped(Path(args.work, "qwen2-0.5b-shaped" + ("-quick" if args.quick else "")),
                              args.quick)
    name = args.run_name or ("qwen2-grpo-colocate" if args.colocate else "qwen2-grpo")
    cfg = load("grpo", [
        f"storage.uri={Path(args.work, 'runs')}", f"storage.run_name={name}", "eval.datasets=[]",
        f"data.prompt_data={data['train']}", f"train.model_path={model}",
        f"rollout.num_rollout={args.steps}", f"rollout.rollout_batch_size={args.prompts}",
        "rollout.n_samples_per_prompt=8", f"rollout.max_response_len={args.response_len}",
        f"train.backend={args.backend}",
        f"train.global_batch_size={args.prompts * 8 // 2}", "train.lr=1e-6",
        f"train.max_tokens_per_micro_batch={args.micro_tokens}",
        f"train.dtype={args.dtype}", f"engine.dtype={args.dtype}",
        f"cluster.colocate={str(args.colocate).lower()}",
        f"train.weight_sync={'tensor' if args.colocate else args.weight_sync}",
        # a random model earns 0 on exact-match arithmetic, and then trains nothing
        "rollout.rm_type=null", "rollout.custom_rm_path=scripts.gpu.rewards:even_tokens",
        "logging.plot=false", *args.set,
    ])
    t0 = time.perf_counter()
    res = train(cfg)
    seconds = time.perf_counter() - t0
    gpus = cfg.cluster.train_ranks
    engines = cfg.engine.num_engines
    # the torch trainer's sharding (ddp or fsdp2), megatron's tensor parallelism
    trainer = (f"torch trainer {cfg.train.strategy}" if args.backend == "torch"
               else f"megatron trainer TP={cfg.train.tensor_parallel}")
    if args.colocate:
        where = "colocated on one GPU" if gpus == 1 else (
            f"{trainer} colocated with {engines} engines on {gpus} GPUs")
    elif gpus == 1 and engines == 1:
        where = "trainer GPU 0, engine GPU 1"
    else:
        where = (f"{trainer} on {gpus} GPUs, "
                 f"{engines} engines on their own GPUs"
                 + (" behind sglang-router" if cfg.rollout.use_router else ""))
    summary = print_table("qwen2-0.5B-shaped GRPO, " + where, step_rows(res["run_dir"]), model,
                          args.peak_tflops, gpus)
    print("result " + json.dumps({**summary, "flow_s": round(seconds, 1),
                                  "weight_sync": cfg.train.weight_sync, "engines": engines,
                                  "router": cfg.rollout.use_router}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["arithmetic", "qwen"])
    ap.add_argument("--work", default=os.environ.get("E2E_WORK", "/tmp/rf-e2e"))
    ap.add_argument("--backend", default="torch", choices=["torch", "megatron"])
    ap.add_argument("--family", default="llama", choices=["llama", "qwen3", "qwen3_moe"],
                    help="arithmetic: the tiny model's family (examples/arithmetic/build_model.py)")
    ap.add_argument("--sft-rollouts", type=int, default=None,
                    help="arithmetic: SFT warm-start steps (default: sft.yaml's)")
    ap.add_argument("--weight-sync", default="distributed", choices=["distributed", "tensor", "disk"])
    ap.add_argument("--colocate", action="store_true")
    ap.add_argument("--run-name", default=None, help="qwen: the run's name (default: "
                    "qwen2-grpo, or qwen2-grpo-colocate)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step (8 samples each)")
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--micro-tokens", type=int, default=4096,
                    help="train.max_tokens_per_micro_batch (a 152k vocab: ~2.4 GB of fp32 "
                    "logits per 4k tokens, several copies live in the loss)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 per GPU (H200)")
    ap.add_argument("--quick", action="store_true", help="CPU check: fewer, smaller steps")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.part == "arithmetic":
        arithmetic(args)
    else:
        qwen(args)


if __name__ == "__main__":
    main()
