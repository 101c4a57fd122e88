"""torch and megatron agree on every algorithm: two `train()` calls from identical
weights and samples on one GPU, float32; prints the table of largest differences
(`tests/support/parity.py` says what each column is). The Qwen2 model runs every case; Qwen3
(q/k norms) and Qwen3-MoE (router, experts) run the cases that exercise each part of a model:
the policy loss, a reference model, a critic; Qwen3-MoE also with routing replay of random
recorded experts (both backends must route by them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import parity
from tests.support.gpu import save_qwen2_tiny, save_qwen3_tiny

pytestmark = pytest.mark.gpu

LIMITS = {"loss": 2e-4, "terms": 2e-4, "grad_norm_rel": 1e-3, "logprobs": 1e-3,
          "weights_rel_update": 0.3}


def test_every_algorithm_matches_torch(qwen2_tiny_dir: str, tmp_path: Path) -> None:
    teacher = save_qwen2_tiny(str(tmp_path / "teacher"), seed=1)
    rows = [parity.compare(name, qwen2_tiny_dir, teacher) for name in parity.CASES]
    print("\n" + parity.table(rows))
    problems = [f"{r['case']}: {k} {r[k]:.2e} > {limit:.0e}"
                for r in rows for k, limit in LIMITS.items() if not r[k] <= limit]
    assert not problems, "\n".join(problems)


FAMILY_CASES = ("grpo", "grpo+kl_loss+entropy", "gspo", "ppo+critic")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_qwen3_families_match_torch(family: str, tmp_path: Path) -> None:
    model = save_qwen3_tiny(str(tmp_path / family), moe=family == "qwen3_moe")
    cases = FAMILY_CASES + (tuple(parity.MOE_CASES) if family == "qwen3_moe" else ())
    rows = [{**parity.compare(name, model, model), "case": f"{family} {name}"} for name in cases]
    print("\n" + parity.table(rows))
    problems = [f"{r['case']}: {k} {r[k]:.2e} > {limit:.0e}"
                for r in rows for k, limit in LIMITS.items() if not r[k] <= limit]
    assert not problems, "\n".join(problems)
