"""Megatron TP=2 behind the train group (2 GPUs): every rank joins the weight
export (a collective over the TP ranks), rank 0's HF-named weights equal the HF model's
exactly, a train step moves them, `push_weights` (distributed sync, here over gloo to an
embedded engine on the CPU) leaves the engine holding exactly the trainer's weights, and
(torchrun) a checkpoint of both ranks' shards loads into fresh ranks bit for bit.

Two drivers of the same `TrainActor`s: a Ray `TrainGroup` (one GPU actor per rank, as a run
creates it) when Ray is importable, and torchrun (one process per rank, no Ray).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from storage.run_layout import RunLayout
from tests.support.gpu import NCCL_SAFE_ENV, REPO, group_config, needs_two, write_step

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2), needs_two]
ENGINE_SCRIPT = """
import sys
from engines.inference.engine_actor import EngineActor
from flows.config.run import EngineConfig
cfg = EngineConfig(backend="embedded", model_path=sys.argv[1], device="cpu")
actor = EngineActor(cfg, 0, num_threads=2)
print("URL", actor.url(), flush=True)
sys.stdin.read()
actor.shutdown()
"""


class _Dict:
    """A plain state dict as a `WeightSource`."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.state

    def save_hf(self, path: str) -> None:
        raise NotImplementedError


@pytest.fixture
def engine_url(qwen2_tiny_dir: str) -> Iterator[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, qwen2_tiny_dir], cwd=REPO,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline()
    if not line.startswith("URL "):
        proc.kill()
        pytest.fail(f"engine did not start: {line!r}")
    try:
        yield line.split()[1]
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _check(model_dir: str, w0: dict[str, torch.Tensor], w1: dict[str, torch.Tensor],
           versions: list[int], url: str) -> None:
    from transformers import AutoModelForCausalLM

    from engines.weights.sender import check_weight_update_equal

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert w0.keys() == hf.keys()
    assert all(torch.equal(w0[k], hf[k]) for k in hf), "TP=2 export != HF weights"
    moved = max(float((w1[k] - w0[k]).abs().max()) for k in w0)
    assert moved > 1e-4, "the train step did not move the weights"
    assert versions == [1]
    check_weight_update_equal(_Dict(w1), [url])  # the engine holds the trained weights
    print(f"TP=2 group: export == HF, step moved weights by {moved:.2e}, engine at v1")


@pytest.mark.timeout(300)
def test_tp2_group_through_torchrun(qwen2_tiny_dir: str, engine_url: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, **NCCL_SAFE_ENV,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "-m", "tests.gpu.group_worker", str(tmp_path / "runs"), qwen2_tiny_dir, engine_url,
           str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    if proc.returncode:
        pytest.fail(f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    result = json.loads((out / "result.json").read_text())
    w0, w1, restored = (torch.load(out / f"weights_{k}.pt", weights_only=True)
                        for k in (0, 1, "restored"))
    _check(qwen2_tiny_dir, w0, w1, result["versions"], engine_url)
    # the TP=2 checkpoint holds both ranks' shards: fresh ranks load it, bit for bit
    assert result["checkpoint"] and result["rebuilt"]["replayed"] == []
    assert result["rebuilt"]["version"] == 1
    assert all(torch.equal(restored[k], w1[k]) for k in w1), "restored TP=2 weights differ"
    print("TP=2 checkpoint: stored, loaded by fresh ranks, weights equal")


@pytest.mark.timeout(300)
def test_tp2_group_through_ray(qwen2_tiny_dir: str, engine_url: str, tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from engines.cluster.train_group import get_or_create_group
    from engines.train.train_actor import TrainActor

    namespace = "rollflow-gpu-tests"
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    ray.init(address="local", num_cpus=4, num_gpus=2, namespace=namespace,
             include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"PYTHONPATH": path, **NCCL_SAFE_ENV}})
    try:
        cfg = group_config(str(tmp_path / "runs"), qwen2_tiny_dir, "tp2-ray", "distributed")
        write_step(cfg)
        names = ["tp2-ray:rank0", "tp2-ray:rank1"]
        group = get_or_create_group(
            names, namespace,
            lambda rank, world: ray.remote(TrainActor).options(
                name=names[rank], namespace=namespace, lifetime="detached", num_gpus=1,
                num_cpus=0, max_restarts=0).remote(cfg, rank, world),
            collective_export=True,
        )
        try:
            w0 = ray.get(group.weights.remote())
            loss = ray.get(group.train_step.remote(0))["loss"]
            w1 = ray.get(group.weights.remote())
            versions = ray.get(group.push_weights.remote([engine_url]))
            ray.get(group.close_weight_sender.remote())
            assert torch.isfinite(torch.tensor(loss))
            _check(qwen2_tiny_dir, w0, w1, versions, engine_url)
            assert ray.get(group.save_checkpoint.remote(0))  # every rank's shards, stored
            layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
            assert layout.latest_checkpoint() == 0
            shards = {p.name.split("_")[2] for p in
                      Path(layout.store.path("checkpoints", "000000", "dist_ckpt")).glob("__*.distcp")}
            assert shards == {"0", "1"}, f"stored shards of ranks {shards}"
        finally:
            group.kill()
    finally:
        ray.shutdown()
