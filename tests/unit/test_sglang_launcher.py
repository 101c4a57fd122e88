"""The SGLang backend: the launch command and the external-server path (no sglang needed)."""

from __future__ import annotations

import pytest

from engines.inference.sglang_launcher import launch_command, wait_healthy
from flows.config.run import EngineConfig


def test_launch_command_uses_sglang_flags():
    cfg = EngineConfig(backend="sglang", model_path="/models/qwen", dtype="bfloat16", max_batch_size=64)
    cmd = launch_command(cfg, port=31000, tp_size=2)
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--model-path"] == "/models/qwen"
    assert flags["--port"] == "31000" and flags["--tp-size"] == "2"
    assert flags["--dtype"] == "bfloat16" and flags["--host"] == "127.0.0.1"


def test_launch_needs_a_model():
    with pytest.raises(ValueError, match="engine.model_path"):
        launch_command(EngineConfig(backend="sglang"), port=1)


def test_wait_healthy_times_out_on_a_dead_url():
    with pytest.raises(TimeoutError, match="did not become healthy"):
        wait_healthy("http://127.0.0.1:9", None, timeout_s=1.5)


def test_a_placed_multi_gpu_engine_sees_its_gpus_by_id():
    from engines.inference.sglang_launcher import server_env

    cfg = EngineConfig(backend="sglang", model_path="/models/qwen")
    cmd = launch_command(cfg, port=31000, tp_size=2, base_gpu_id=4)
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--tp-size"] == "2" and flags["--base-gpu-id"] == "4"
    assert "--base-gpu-id" not in launch_command(cfg, port=31000)
    ray_env = {"CUDA_VISIBLE_DEVICES": "4", "PATH": "/bin"}
    assert server_env(4, ray_env) == {"PATH": "/bin"}  # Ray's narrowing is undone
    assert server_env(None, ray_env) == ray_env


def test_an_expert_parallel_engine_gets_sglangs_ep_size():
    cfg = EngineConfig(backend="sglang", model_path="/models/qwen3-moe", expert_parallel=2)
    cmd = launch_command(cfg, port=31000, tp_size=2)
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--tp-size"] == "2" and flags["--ep-size"] == "2"
    assert "--ep-size" not in launch_command(EngineConfig(backend="sglang", model_path="/m"), 1)
