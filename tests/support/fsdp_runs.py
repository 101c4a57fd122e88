"""Two GRPO steps of the torch trainer under a train strategy, recorded for comparison: what
tests/integration/test_fsdp2.py (gloo, CPU) and tests/gpu/test_fsdp2.py (NCCL) share."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engines.train.torch_backend import TorchTrainBackend
from flows.config.run import AlgorithmConfig, TrainConfig
from tests.support.samples import grouped_samples

TOL = 1e-5
COMPARED = ("loss", "pg_loss", "grad_norm", "entropy", "approx_kl", "clipfrac")


def batch(step: int) -> list[Any]:
    """9 groups of 4, in optimizer steps of 9 samples: 5 for rank 0, 4 for rank 1, about one
    sample a micro-batch (`backend`'s token budget), so the ranks' counts differ."""
    return grouped_samples(groups=9, per_group=4, seed=step)


def backend(model_dir: str, strategy: str, load: str | None = None, **train: Any
            ) -> TorchTrainBackend:
    cfg = TrainConfig.model_validate({
        "model_path": model_dir, "load": load, "lr": 1e-3, "seed": 7, "strategy": strategy,
        "global_batch_size": 9, "max_tokens_per_micro_batch": 16, "share_prompts": False,
        **train,
    })
    return TorchTrainBackend(cfg, AlgorithmConfig(), num_threads=1)


def train(trainer: TorchTrainBackend, steps: range,
          make_batch: Callable[[int], list[Any]] = batch) -> dict[str, Any]:
    """Per step: the compared metrics and the log-probs of the step's batch after it."""
    record: dict[str, Any] = {"metrics": [], "log_probs": []}
    for k in steps:
        metrics = trainer.train(make_batch(k), k)
        record["metrics"].append({key: metrics[key] for key in COMPARED})
        record["log_probs"].append(trainer.compute_log_probs(make_batch(k)))
    return record


def count_micro_batches(trainer: TorchTrainBackend) -> list[int]:
    """This rank's micro-batches per optimizer step, as the step cuts them (before the
    FSDP2 padding), appended to the returned list as the steps run."""
    counts: list[int] = []
    cut = trainer.step.micro_batches

    def counted(samples: list[Any], idx: list[int]) -> list[Any]:
        out = cut(samples, idx)
        counts.append(len(out))
        return out

    trainer.step.micro_batches = counted  # type: ignore[method-assign]
    return counts


def save(path: Path, record: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    torch.save({k: v.detach().cpu().clone() for k, v in weights.items()}, f"{path}.pt")
    path.with_suffix(".json").write_text(json.dumps(record))


def load(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return json.loads(path.with_suffix(".json").read_text()), torch.load(f"{path}.pt")


def assert_close(a: dict[str, Any], b: dict[str, Any], tol: float = TOL) -> None:
    for ma, mb in zip(a["metrics"], b["metrics"], strict=True):
        for key in COMPARED:
            assert abs(ma[key] - mb[key]) <= tol, (key, ma[key], mb[key])
    for la, lb in zip(a["log_probs"], b["log_probs"], strict=True):
        for ra, rb in zip(la, lb, strict=True):
            torch.testing.assert_close(torch.tensor(ra), torch.tensor(rb), atol=tol, rtol=0)


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor],
                        tol: float = TOL) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=tol, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def initial_weights(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
