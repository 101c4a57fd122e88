"""Weight sync: trainer-side senders against real engines (one in its own process, gloo)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.inference.engine_actor import EngineActor
from engines.weights.hf_export import engine_state_dict
from engines.weights.sender import (
    DiskWeightSender,
    DistributedWeightSender,
    PushLayout,
    TensorWeightSender,
    WeightSyncError,
    build_weight_sender,
    check_weight_update_equal,
)
from engines.weights.sync import buckets, decode_named_tensors, encode_named_tensors
from examples.arithmetic.build_model import save_tiny_model
from flows.config.run import TrainConfig
from tests.support.engines import embedded_engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
ENGINE_SCRIPT = """
import sys, torch
from engines.inference.engine_actor import EngineActor
from engines.weights.hf_export import engine_state_dict
from flows.config.run import EngineConfig
actor = EngineActor(EngineConfig(backend="embedded", model_path=sys.argv[1]), 0, num_threads=1)
print(actor.url(), flush=True)
sys.stdin.read()
actor.shutdown()
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("ws") / "tiny"))


def perturbed(model_dir: str, seed: int) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def generate(url: str) -> dict[str, Any]:
    body = {"input_ids": [5, 6, 7], "sampling_params": GREEDY, "return_logprob": True}
    return dict(httpx.post(f"{url}/generate", json=body, timeout=60).json())


@pytest.fixture()
def engine(model_dir: str) -> Iterator[EngineActor]:
    with embedded_engine(model_dir) as actor:
        yield actor


def test_buckets_and_encoding_round_trip() -> None:
    named = [(f"w{i}", torch.full((i + 1, 4), float(i))) for i in range(5)]
    groups = list(buckets(named, bucket_bytes=64))  # 16, 32, 48, 64, 80 bytes
    assert [[n for n, _ in g] for g in groups] == [["w0", "w1"], ["w2"], ["w3"], ["w4"]]
    assert [len(g) for g in buckets(named, 10**6)] == [5]
    back = decode_named_tensors(encode_named_tensors(named))
    assert [n for n, _ in back] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back, named, strict=True))
    with pytest.raises(ValueError, match="base64"):
        decode_named_tensors("not base64!")


def test_distributed_gloo_update_reaches_an_engine_in_another_process(model_dir: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE_SCRIPT, model_dir],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), f"engine process did not start: {url!r}"
        model = perturbed(model_dir, seed=1)
        with pytest.raises(WeightSyncError, match="differ"):
            check_weight_update_equal(model, [url])
        before = generate(url)
        sender = DistributedWeightSender([url], bucket_bytes=64 * 1024, backend="gloo")
        sender.connect()
        start = time.perf_counter()
        assert sender.update(model, version=7) == [7]
        print(f"distributed gloo update: {time.perf_counter() - start:.3f}s")
        check_weight_update_equal(model, [url])
        after = generate(url)
        assert after["meta_info"]["weight_version"] == 7
        assert after["output_ids"] != before["output_ids"] or after != before
        sender.close()
    finally:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=30)


TRAINER_SCRIPT = """
import sys
from transformers import AutoModelForCausalLM
from engines.weights.sender import DistributedWeightSender
sender = DistributedWeightSender([sys.argv[1]], bucket_bytes=64 * 1024, backend="gloo")
sender.connect()
print(sender.update(AutoModelForCausalLM.from_pretrained(sys.argv[2]), version=1), flush=True)
sys.stdin.read()
"""


def test_distributed_sync_works_again_after_the_trainer_is_killed(
    engine: EngineActor, model_dir: str
) -> None:
    """A trainer killed after joining leaves the engine in its group; the restarted trainer
    joins under the same name (was: refused, "group already exists", and rank 0 waited for
    the engine until the 300 s store timeout)."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER_SCRIPT, engine.url(), model_dir],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert trainer.stdout is not None
        assert trainer.stdout.readline().strip() == "[1]"  # joined and pushed version 1
    finally:
        trainer.kill()  # no close(): the engine keeps the dead trainer's group
        trainer.wait(timeout=30)

    model = perturbed(model_dir, seed=3)
    restarted = DistributedWeightSender([engine.url()], bucket_bytes=64 * 1024, backend="gloo")
    pool = ThreadPoolExecutor(1)  # a refused join blocks rank 0: fail, do not hang
    try:
        pool.submit(restarted.connect).result(timeout=120)
    finally:
        pool.shutdown(wait=False)
    try:
        assert restarted.update(model, version=2) == [2]
        check_weight_update_equal(model, [engine.url()])
    finally:
        restarted.close()


def test_tensor_sender_over_http_changes_outputs_and_version(
    engine: EngineActor, model_dir: str
) -> None:
    before = generate(engine.url())
    model = perturbed(model_dir, seed=2)
    sender = TensorWeightSender([engine.url()], bucket_bytes=256 * 1024)
    assert sender.update(model, version=3) == [3]
    sender.close()
    after = generate(engine.url())
    assert after["meta_info"]["weight_version"] == 3
    assert (
        after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    )
    assert check_weight_update_equal(model, [engine.url()]) == engine.weights_checksum()


def test_disk_fallback_and_config_registry(
    engine: EngineActor, model_dir: str, tmp_path: Path
) -> None:
    model = perturbed(model_dir, seed=3)
    sender = DiskWeightSender([engine.url()], save_dir=str(tmp_path))
    assert sender.update(model, version=4) == [4]
    assert sender.update(model, version=5) == [5]
    assert [p.name for p in tmp_path.iterdir()] == ["v000005"]
    sender.close()
    check_weight_update_equal(model, [engine.url()])
    cfg = TrainConfig(weight_sync="disk")
    assert isinstance(build_weight_sender(cfg, [engine.url()], PushLayout()), DiskWeightSender)
    with pytest.raises(ValueError, match="at least one engine"):
        build_weight_sender(TrainConfig(weight_sync="tensor"), [], PushLayout())


def test_distributed_update_reaches_two_engines_and_says_where_its_seconds_went(
    model_dir: str,
) -> None:
    """One process group, trainer rank 0 and two engines (ranks 1, 2), as a disaggregated run
    with `engine.num_engines=2` has it: both engines end with the trainer's weights and
    version, and the sender's `timings` break the update down (the flow stores them as
    `broadcast_weights/push/*`)."""
    model = perturbed(model_dir, seed=4)
    with embedded_engine(model_dir) as first, embedded_engine(model_dir) as second:
        urls = [first.url(), second.url()]
        sender = DistributedWeightSender(urls, bucket_bytes=64 * 1024, backend="gloo")
        try:
            sender.connect()
            assert set(sender.timings) == {"connect_s"}
            assert sender.update(model, version=3) == [3, 3]
            check_weight_update_equal(model, urls)
            first_push = dict(sender.timings)
            assert sender.update(model, version=4) == [4, 4]
        finally:
            sender.close()
    assert {"connect_s", "pause_s", "export_s", "to_device_s", "broadcast_s",
            "first_broadcast_s", "engines_s", "push_s", "flush_s", "continue_s",
            "versions_s", "buckets", "bytes"} <= set(first_push)
    assert "connect_s" not in sender.timings  # only the push that set the group up has one
    assert first_push["buckets"] > 1 and first_push["bytes"] == sum(
        t.numel() * t.element_size() for t in engine_state_dict(model).values())
    assert all(v >= 0 for v in first_push.values())
