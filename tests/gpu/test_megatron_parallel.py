"""TP=2, PP=2 and DP=2 against one GPU: same weights and batch, same numbers (>= 2 GPUs).

Each layout runs as its own `torchrun` job (megatron's process groups are per process), the
jobs side by side, on an untied and a tied-embedding model: PP=2 with tied embeddings keeps
a copy of the word embeddings on the last stage and must all-reduce its gradient with the
first stage's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.gpu import NCCL_SAFE_ENV, REPO, needs_two, save_qwen2_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}
MODEL_NAMES = ("untied", "tied")
# Max |layout - one GPU| / |update| per tensor. Adam's early steps are ~lr * sign(grad), so
# reduction-order noise in near-zero gradients moves TP's LM head by ~10% of its update;
# a missing or wrong gradient reduction gives ~100%.
UPDATE_TOL = 0.3
JOB_TIMEOUT_S = 300  # all the torchrun jobs, side by side


def start(out: Path, models: list[str], nproc: int, tp: int, pp: int) -> subprocess.Popen[bytes]:
    """One layout's torchrun job, its output to `out/log.txt`."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **NCCL_SAFE_ENV,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "tests.gpu.megatron_parallel_worker",
           f"--tp={tp}", f"--pp={pp}", f"--out={out}", *models]
    with open(out / "log.txt", "wb") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen[bytes], out: Path, timeout_s: float) -> dict[str, Any]:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.returncode:
        log = (out / "log.txt").read_text(errors="replace")
        pytest.fail(f"{proc.args} failed ({proc.returncode}):\n{log[-8000:]}")
    return dict(json.loads((out / "result.json").read_text()))


Run = tuple[dict[str, Any], Path]


@pytest.fixture(scope="module")
def run_layout(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[str], Run]]:
    """`run_layout(name)`: that layout's results. The torchrun jobs of the one-GPU base and
    of every layout this session's tests ask for (`-k tp2`: base and TP=2 only) start
    together at the first call, side by side on the same GPUs (one after another, each job's
    start-up and first compile made the module several minutes long)."""
    root = tmp_path_factory.mktemp("mcore-parallel")
    models = [save_qwen2_tiny(str(root / name), tie_word_embeddings=name == "tied")
              for name in MODEL_NAMES]
    wanted = ["base"] + sorted({item.callspec.params["layout"] for item in request.session.items
                                if item.path == request.path and hasattr(item, "callspec")})
    jobs: dict[str, subprocess.Popen[bytes]] = {}
    done: dict[str, Run] = {}
    deadline = 0.0

    def get(name: str) -> Run:
        nonlocal deadline
        if not jobs:
            deadline = time.monotonic() + JOB_TIMEOUT_S
            for job in wanted:
                nproc, (tp, pp) = (1, (1, 1)) if job == "base" else (2, LAYOUTS[job])
                jobs[job] = start(root / job, models, nproc, tp, pp)
        if name not in done:
            left = max(1.0, deadline - time.monotonic())
            done[name] = (finish(jobs[name], root / name, left), root / name)
        return done[name]

    yield get
    for proc in jobs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def update_errors(got_dir: Path, base_dir: Path, m: int, k: int) -> dict[str, float]:
    """Per HF tensor: |layout's weights - one GPU's| / |one GPU's update| after step k.

    Relative to the step's own update (see UPDATE_TOL): an elementwise bound would flake.
    """
    if k == 0:
        from transformers import AutoModelForCausalLM

        model_dir = base_dir.parent / MODEL_NAMES[m]
        before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    else:
        before = torch.load(base_dir / f"weights_{m}_{k - 1}.pt", weights_only=True)
    ref = torch.load(base_dir / f"weights_{m}_{k}.pt", weights_only=True)
    got = torch.load(got_dir / f"weights_{m}_{k}.pt", weights_only=True)
    assert got.keys() == ref.keys()
    return {n: float((got[n] - ref[n]).norm() / (ref[n] - before[n]).norm().clamp_min(1e-12))
            for n in ref}


@needs_two
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_one_gpu(run_layout: Callable[[str], Run], layout: str) -> None:
    base, base_dir = run_layout("base")
    got, got_dir = run_layout(layout)
    problems = []
    for m, (ours, ref) in enumerate(zip(got["models"], base["models"], strict=True)):
        what = f"{layout} {MODEL_NAMES[m]}"
        if ours["export_mismatch"]:  # sharded -> HF export must be exact
            problems.append(f"{what}: export differs: {ours['export_mismatch'][:5]}")
        if not all(ours["dp_agree"]):
            problems.append(f"{what}: DP replicas diverged: {ours['dp_agree']}")
        lp_err = max(float((torch.tensor(a) - torch.tensor(b)).abs().max())
                     for a, b in zip(ours["log_probs"], ref["log_probs"], strict=True))
        if lp_err > 1e-4:
            problems.append(f"{what}: log-probs differ by {lp_err:.2e}")
        for k, (s, r) in enumerate(zip(ours["steps"], ref["steps"], strict=True)):
            errs = update_errors(got_dir, base_dir, m, k)
            worst = sorted(errs.items(), key=lambda kv: -kv[1])[:4]
            print(f"{what} step {k}: loss {s['loss']:.7f}/{r['loss']:.7f} grad_norm "
                  f"{s['grad_norm']:.6f}/{r['grad_norm']:.6f} worst update errors {worst}")
            for key in ("loss", "pg_loss", "kl_loss", "entropy", "approx_kl", "clipfrac"):
                # rel 1e-3: TP's kl_loss after one step differs by ~2e-4 (the Adam noise above)
                if s[key] != pytest.approx(r[key], rel=1e-3, abs=2e-5):
                    problems.append(f"{what} step {k}: {key} {s[key]} vs {r[key]}")
            if s["grad_norm"] != pytest.approx(r["grad_norm"], rel=1e-3):
                problems.append(f"{what} step {k}: grad_norm {s['grad_norm']} vs {r['grad_norm']}")
            if worst[0][1] > UPDATE_TOL:
                problems.append(f"{what} step {k}: weights differ: {worst}")
    print("\n".join(problems))
    assert not problems, "\n".join(problems)
