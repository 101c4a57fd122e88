"""One rank of a megatron parallelism check, launched by `test_megatron_parallel.py`:

    torchrun --nproc-per-node 2 -m tests.gpu.megatron_parallel_worker --tp 2 --out DIR M1 M2

For each model directory: build the backend at the given TP/PP (DP = world / (TP*PP)),
check that its HF export equals the HF weights exactly, score log-probs, then run `CALLS`
`train()` calls of one optimizer step each (the whole batch), exporting after each. Rank 0
writes `DIR/result.json` (log-probs and per-step metrics) and `DIR/weights_{m}_{k}.pt` (HF
weights of model m after step k), so the test can compare every layout with the one-GPU
run on the same weights and batch, step by step.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from flows.config.run import AlgorithmConfig, TrainConfig
from tests.support.gpu import grpo_samples

# KL to a reference and an entropy bonus: exercises the ref model and vocab-parallel entropy.
ALGO = {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01}
KEYS = ("loss", "pg_loss", "kl_loss", "entropy", "approx_kl", "clipfrac", "grad_norm")
CALLS = 3


def dp_replicas_agree(model: torch.nn.Module) -> bool:
    """Every DP rank holds the same local parameters (the optimizer's param all-gather ran)."""
    from engines.train.megatron import parallel

    sums = {k: float(v.double().sum()) for k, v in model.state_dict().items()
            if not k.endswith("_extra_state")}
    return all(s == sums for s in parallel.all_gather_dp(sums))


def run_model(path: str, tp: int, pp: int, out: str, m: int) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    from engines.train.megatron import MegatronTrainBackend

    train = TrainConfig(model_path=path, lr=1e-3, dtype="float32", global_batch_size=None,
                        max_tokens_per_micro_batch=64, seed=7)
    backend = MegatronTrainBackend(train, AlgorithmConfig.model_validate(ALGO),
                                   tensor_parallel=tp, pipeline_parallel=pp)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    exported = backend.state_dict_for_engine()
    mismatched = sorted(k for k, v in hf.items() if not torch.equal(exported[k], v))
    samples = grpo_samples()
    log_probs = backend.compute_log_probs(samples)
    steps, agree = [], []
    for k in range(CALLS):
        steps.append({key: v for key, v in backend.train(samples, k).items() if key in KEYS})
        agree.append(dp_replicas_agree(backend.model.module))
        weights = backend.state_dict_for_engine()
        if dist.get_rank() == 0:
            torch.save(weights, os.path.join(out, f"weights_{m}_{k}.pt"))
    return {"export_mismatch": mismatched, "log_probs": log_probs, "steps": steps,
            "dp_agree": agree}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    results = [run_model(path, args.tp, args.pp, args.out, m) for m, path in enumerate(args.models)]
    if dist.get_rank() == 0:
        info = {"tp": args.tp, "pp": args.pp, "world": dist.get_world_size(), "models": results}
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(info, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
