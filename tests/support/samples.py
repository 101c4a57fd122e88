"""Inputs the unit tests build by hand: samples for the train backends, prompt files, a
torch backend on the session's tiny model, and the unfused token statistics of an LM head."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import Tensor

from engines.algorithms.losses import entropy_from_logits
from engines.train.batching import log_probs_from_logits
from engines.train.torch_backend import TorchTrainBackend
from flows.config.run import AlgorithmConfig, TrainConfig
from storage.sample import Sample

VOCAB_LOW, VOCAB_HIGH = 4, 70  # real characters of the char tokenizer

TOL = 1e-5


def make_samples(n: int, group_size: int = 4, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p_len, r_len = (int(x) for x in torch.randint(2, 8, (2,), generator=g))
        tokens = torch.randint(VOCAB_LOW, VOCAB_HIGH, (p_len + r_len,), generator=g).tolist()
        mask = [1] * r_len
        mask[0] = 0 if r_len > 2 else 1  # a tool token now and then
        out.append(
            Sample(
                index=100 + i,
                group_index=i // group_size,
                tokens=tokens,
                response_length=r_len,
                loss_mask=mask,
                reward=float((i * 7) % 3 == 0),
            )
        )
    return out


def grouped_samples(groups: int, per_group: int, seed: int = 0) -> list[Sample]:
    """`groups` prompts of different lengths, `per_group` responses each (lengths 0..5, one
    masked token now and then), interleaved so that a group's samples are not adjacent."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 70, (2 + k,), generator=g).tolist() for k in range(groups)]
    out = []
    for j in range(per_group):
        for k, prompt in enumerate(prompts):
            r = int(torch.randint(0, 6, (1,), generator=g))
            response = torch.randint(4, 70, (r,), generator=g).tolist()
            mask = [int(t % 5 != 0) for t in response]
            out.append(Sample(index=len(out), group_index=k, tokens=prompt + response,
                              response_length=r, loss_mask=mask, reward=float(j % 2)))
    return out


def long_samples(groups: int, per_group: int, seed: int = 0) -> list[Sample]:
    """Like `grouped_samples`, longer: prompts of 6 to 24 tokens and responses of 0 to 40,
    for rows that a context-parallel split cuts into several chunks."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(VOCAB_LOW, VOCAB_HIGH, (int(torch.randint(6, 25, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(groups)]
    out = []
    for j in range(per_group):
        for k, prompt in enumerate(prompts):
            r = int(torch.randint(0, 41, (1,), generator=g))
            response = torch.randint(VOCAB_LOW, VOCAB_HIGH, (r,), generator=g).tolist()
            mask = [int(t % 5 != 0) for t in response]
            out.append(Sample(index=len(out), group_index=k, tokens=prompt + response,
                              response_length=r, loss_mask=mask, reward=float((j + k) % 2)))
    return out


def make_backend(
    model_dir: str,
    algo: dict[str, Any] | None = None,
    temperature: float = 1.0,
    **train_kw: Any,
) -> TorchTrainBackend:
    cfg = TrainConfig.model_validate({"model_path": model_dir, "lr": 1e-3, "seed": 7, **train_kw})
    return TorchTrainBackend(
        cfg, AlgorithmConfig.model_validate(algo or {}), temperature, num_threads=1
    )


def assert_trains_the_same(
    model_dir: str, first: dict[str, Any], second: dict[str, Any], **common: Any
) -> tuple[TorchTrainBackend, TorchTrainBackend]:
    """Two backends (train settings `first` and `second`, both with `common`) take the same
    two optimizer steps from one start: the same metrics within 1e-5 and weights within
    5e-5. Returns both, trained, for checks of a test's own."""
    import pytest

    samples = grouped_samples(groups=4, per_group=4, seed=1)
    for s in samples:
        s.status = "completed"
    backends, runs = [], []
    for settings in (first, second):
        backend = make_backend(model_dir, global_batch_size=8, **common, **settings)
        metrics = backend.train(samples, rollout_id=0)
        backends.append(backend)
        runs.append((metrics, torch.cat([p.detach().flatten() for p in backend.model.parameters()])))
    (m0, w0), (m1, w1) = runs
    assert m0["num_optimizer_steps"] == 2.0
    for key in ("loss", "pg_loss", "entropy", "approx_kl", "grad_norm"):
        assert m1[key] == pytest.approx(m0[key], abs=1e-5), key
    # Adam divides by sqrt(v): where a gradient is ~0, rounding moves a weight by up to a
    # fraction of lr (1e-3), so weights agree to 5% of one step, not to float precision
    torch.testing.assert_close(w1, w0, atol=5e-5, rtol=0)
    return backends[0], backends[1]


def write_jsonl(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return str(path)


# -- token statistics of a vocabulary-parallel head, by the unfused formulas --
HEAD_VOCAB = 40


def reference_token_stats(
    logits: Tensor, targets: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    z = logits.float() / temperature
    return log_probs_from_logits(z, targets), entropy_from_logits(z)


def weighted_grads(
    logits: Tensor, fn: Any, w_lp: Tensor, w_h: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    x = logits.detach().clone().requires_grad_(True)
    lp, h = fn(x)
    ((lp * w_lp).sum() + (h * w_h).sum()).backward()
    assert x.grad is not None
    return lp.detach(), h.detach(), x.grad.float()
