"""The SGLang HTTP surface, end to end: EngineActor's uvicorn server driven by SGLangClient."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.engine_actor import EngineActor, build_generator
from engines.inference.gen_types import GenRequest, GenResult, SamplingParams
from engines.inference.mock_generator import MockGenerator
from engines.inference.scheduler import ContinuousScheduler
from engines.process import tls_verify
from engines.rollout.sglang_client import SGLangClient, SGLangError, parse_output
from examples.arithmetic.build_model import save_tiny_model
from flows.config.run import EngineConfig
from tests.support import REPO_ROOT
from tests.support.engines import embedded_engine

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
# Tries at pausing a 120-token request mid-generation: it takes ~50 ms, and a machine running
# three test workers can deschedule the test for longer (5 tries all missed in a CI run).
ATTEMPTS = 30


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("srv") / "tiny"))


@pytest.fixture()
def engine(model_dir: str) -> Iterator[EngineActor]:
    with embedded_engine(model_dir) as actor:
        yield actor


def prompt_ids(engine: EngineActor, text: str) -> list[int]:
    return engine.generator.tokenize(text)


def test_generate_single_and_batch_round_trip(engine: EngineActor) -> None:
    prompts = [prompt_ids(engine, t) for t in ["1+2=", "what is 12*3?", "x"]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    direct = engine.generator.generate(
        [GenRequest(str(i), p, params) for i, p in enumerate(prompts)], lambda rid: False
    )

    async def main() -> None:
        async with SGLangClient(engine.url()) as client:
            single = await client.generate(prompts[0], GREEDY, rid="one")
            batch = await client.generate_batch(prompts, GREEDY, rids=["a", "b", "c"])
            no_lp = await client.generate(prompts[1], GREEDY, return_logprob=False)
        assert single.output_ids == direct[0].output_ids and single.text == direct[0].text
        assert single.log_probs == pytest.approx(direct[0].output_logprobs, abs=1e-6)
        assert single.finish_reason == {"type": "length", "length": 8}
        assert single.weight_version == 0
        assert [b.output_ids for b in batch] == [d.output_ids for d in direct]
        assert no_lp.log_probs == [] and no_lp.output_ids == direct[1].output_ids

    asyncio.run(main())


def test_raw_response_has_sglang_shape(engine: EngineActor) -> None:
    body = {"text": "1+1=", "sampling_params": GREEDY, "return_logprob": True, "rid": "shape"}
    out = httpx.post(f"{engine.url()}/generate", json=body, timeout=30).json()
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert meta["id"] == "shape" and meta["completion_tokens"] == 8
    assert meta["prompt_tokens"] == len(prompt_ids(engine, "1+1="))
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(t[2] is None and t[0] < 0 for t in meta["output_token_logprobs"])
    batch = httpx.post(
        f"{engine.url()}/generate", json={**body, "text": ["1", "2"], "rid": None}, timeout=30
    ).json()
    assert isinstance(batch, list) and len(batch) == 2


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 2.0}}, "top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
        ({"input_ids": [1, 2], "sampling_params": {"stop": 3}}, "stop"),
        ({"input_ids": [], "sampling_params": {}}, "input_ids"),
        ({"input_ids": [1, 10**6]}, "input_ids"),
        ({"sampling_params": {}}, "input_ids"),
        ({"input_ids": [[1], [2]], "rid": ["only-one"]}, "rid"),
    ],
)
def test_bad_input_is_400_naming_the_field(
    engine: EngineActor, body: dict[str, Any], field: str
) -> None:
    response = httpx.post(f"{engine.url()}/generate", json=body, timeout=30)
    assert response.status_code == 400
    assert field in response.json()["error"]["message"]


def test_invalid_json_is_400(engine: EngineActor) -> None:
    response = httpx.post(f"{engine.url()}/generate", content=b"{nope", timeout=30)
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_client_raises_with_server_message(engine: EngineActor) -> None:
    async def main() -> None:
        async with SGLangClient(engine.url()) as client:
            with pytest.raises(SGLangError, match="top_k") as err:
                await client.generate([1, 2], {"top_k": 0})
        assert err.value.status_code == 400

    asyncio.run(main())


def test_abort_over_http_returns_partial_output(engine: EngineActor) -> None:
    """A long batch is running; aborting one rid, then all, ends each with partial output."""
    params = {"max_new_tokens": 120, "ignore_eos": True, "sampling_seed": 0}
    prompts = [prompt_ids(engine, "1+2=")] * 64
    rids = [f"long-{i}" for i in range(len(prompts))]

    async def main() -> None:
        async with SGLangClient(engine.url()) as client:
            task = asyncio.create_task(client.generate_batch(prompts, params, rids=rids))
            while await client.flush_cache():
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.05)
            await client.abort(rids[0])
            await asyncio.sleep(0.05)
            await client.abort_all()
            outs = await task
        for out in outs:
            assert out.finish_reason["type"] == "abort"
            assert len(out.output_ids) < 120 and len(out.log_probs) == len(out.output_ids)
        assert 0 < len(outs[0].output_ids) < len(outs[1].output_ids)
        assert await client_is_idle(engine)

    asyncio.run(main())


async def client_is_idle(engine: EngineActor) -> bool:
    async with SGLangClient(engine.url()) as client:
        return await client.flush_cache()


def await_flush(engine: EngineActor) -> bool:
    return httpx.post(f"{engine.url()}/flush_cache", timeout=30).status_code == 200


def test_control_endpoints(engine: EngineActor) -> None:
    async def main() -> None:
        async with SGLangClient(engine.url()) as client:
            assert await client.health()
            assert await client.health_generate()
            assert await client.flush_cache()
            info = await client.model_info()
            assert info["is_generation"] is True and info["weight_version"] == 0
            await client.abort("no-such-request")

    asyncio.run(main())
    assert httpx.get(f"{engine.url()}/flush_cache", timeout=30).status_code == 200


def test_update_weights_from_tensor_and_disk(engine: EngineActor, tmp_path: Path) -> None:
    prompt = prompt_ids(engine, "3*3=")
    state = {
        k: v + 0.05 * torch.randn_like(v)
        for k, v in cast(EmbeddedGenerator, engine.generator).model.state_dict().items()
    }

    async def generate() -> Any:
        async with SGLangClient(engine.url()) as client:
            return await client.generate(prompt, GREEDY)

    before = asyncio.run(generate())
    assert engine.update_weights_from_tensor(state, 1) == 1 == engine.weight_version()
    after = asyncio.run(generate())
    assert after.weight_version == 1 and after.log_probs != before.log_probs

    model = AutoModelForCausalLM.from_pretrained(str(engine.config.model_path))
    model.save_pretrained(tmp_path / "v2")

    async def from_disk() -> dict[str, Any]:
        async with SGLangClient(engine.url()) as client:
            bad = httpx.post(f"{engine.url()}/update_weights_from_disk", json={}, timeout=30)
            assert bad.status_code == 400 and "model_path" in bad.json()["error"]["message"]
            with pytest.raises(SGLangError):
                await client.update_weights_from_disk(str(tmp_path / "missing"), 9)
            return await client.update_weights_from_disk(str(tmp_path / "v2"), 2)

    assert asyncio.run(from_disk())["success"] is True
    restored = asyncio.run(generate())
    assert restored.weight_version == 2 and restored.output_ids == before.output_ids
    assert restored.log_probs == pytest.approx(before.log_probs, abs=1e-6)


def test_mock_backend_serves_the_same_protocol(model_dir: str) -> None:
    actor = EngineActor(EngineConfig(backend="mock", model_path=model_dir), 1)
    try:

        async def main() -> None:
            async with SGLangClient(actor.url()) as client:
                out = await client.generate([5, 6], {"max_new_tokens": 4, "ignore_eos": True})
                assert len(out.output_ids) == 4 and out.finish_reason["type"] == "length"
                assert await client.health_generate()

        asyncio.run(main())
        assert actor.update_weights_from_tensor({}, 5) == 5
    finally:
        actor.shutdown()
    with pytest.raises(ValueError, match="sglang"):
        build_generator(EngineConfig(backend="sglang", urls=["http://x"]), 0)


MOCK_ACTORS_SCRIPT = """
import sys, tempfile
from engines.inference.engine_actor import EngineActor
from engines.train.train_actor import TrainActor
from flows.config.run import EngineConfig
from storage.batch_io import write_samples
from storage.run_layout import step_dir
from storage.sample import Sample
from tests.support.configs import small_config

cfg = small_config("storage.uri=" + tempfile.mkdtemp(), "storage.run_name=no-torch")
trainer = TrainActor(cfg)
samples = [Sample(index=i, group_index=0, prompt="1+1=", tokens=[5, 6, 7], response_length=1,
                  loss_mask=[1], rollout_log_probs=[-0.5], reward=1.0) for i in range(2)]
write_samples(trainer.layout.store, samples, step_dir(0), "train.arrow")
engine = EngineActor(EngineConfig(backend="mock", model_path=sys.argv[1]), 0)
try:
    assert trainer.train_step(0)["num_samples"] == 2  # a step as a flow runs it
    trainer.save_checkpoint(0)
    assert not trainer.sends_cuda_ipc()  # asked at every push (engines/cluster/engine_pool.py)
    assert engine.update_weights_from_tensor(trainer.weights(), 1) == 1
finally:
    engine.shutdown()
print(sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""


def test_a_mock_runs_trainer_and_engine_never_import_torch(model_dir: str) -> None:
    """Neither holds a tensor: their weights are empty and only the version moves. torch's
    import was about 1.3 CPU-s of each of the ~170 such actors a CI run starts on a 2-core
    machine (bench/RESULTS.md, "CI cost")."""
    out = subprocess.run([sys.executable, "-c", MOCK_ACTORS_SCRIPT, model_dir], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


class CountingGenerator(MockGenerator):
    def __init__(self) -> None:
        super().__init__(vocab_size=32, eos_token_id=0)
        self.batch_sizes: list[int] = []

    def step(self, batch: Any, admit: Sequence[GenRequest]) -> list[GenResult]:
        self.batch_sizes.append(len(admit))
        return super().step(batch, admit)


def test_scheduler_batches_concurrent_requests() -> None:
    gen = CountingGenerator()
    scheduler = ContinuousScheduler(gen, max_batch_size=16, batch_wait_s=0.02)
    scheduler.start()
    try:
        reqs = [GenRequest(f"q{i}", [1, 2, i], SamplingParams(max_new_tokens=3)) for i in range(40)]
        futures = [scheduler.submit([r]) for r in reqs[:20]] + [scheduler.submit(reqs[20:])]
        results = [r for f in futures for r in f.result(timeout=10)]
        with pytest.raises(ValueError, match="Duplicate"):
            scheduler.submit([reqs[0], reqs[0]])
        assert scheduler.submit([]).result(timeout=1) == []
    finally:
        scheduler.stop()
    assert [r.rid for r in results] == [r.rid for r in reqs]  # in order, within a submit too
    assert sum(gen.batch_sizes) == 40 and max(gen.batch_sizes) == 16 and len(gen.batch_sizes) <= 4


def test_a_null_log_prob_is_an_error_naming_the_request_and_token() -> None:
    item = {"text": "ab", "output_ids": [5, 6], "meta_info": {
        "id": "r7", "finish_reason": {"type": "length"}, "weight_version": "3",
        "output_token_logprobs": [[-0.25, 5, None], [None, 6, None]]}}
    with pytest.raises(ValueError, match=r"'r7'.*output_token_logprobs\[1\].*token 6"):
        parse_output(item)
    item["meta_info"]["output_token_logprobs"][1][0] = -1.5
    out = parse_output(item)
    assert out.log_probs == [-0.25, -1.5] and out.output_ids == [5, 6] and out.weight_version == 3


class FailingOnceGenerator(MockGenerator):
    def __init__(self) -> None:
        super().__init__(vocab_size=32, eos_token_id=0)
        self.failed = False

    def step(self, batch: Any, admit: Sequence[GenRequest]) -> list[GenResult]:
        if not self.failed:
            self.failed = True
            raise RuntimeError("decode step blew up")
        return super().step(batch, admit)


def test_a_failed_step_fails_its_submit_and_the_scheduler_goes_on() -> None:
    scheduler = ContinuousScheduler(FailingOnceGenerator(), batch_wait_s=0.01)
    scheduler.start()
    try:
        reqs = [GenRequest(f"f{i}", [1, 2, i], SamplingParams(max_new_tokens=2)) for i in range(3)]
        with pytest.raises(RuntimeError, match="blew up"):
            scheduler.submit(reqs).result(timeout=10)
        again = scheduler.submit(reqs).result(timeout=10)  # the failed rids are free again
    finally:
        scheduler.stop()
    assert [r.rid for r in again] == ["f0", "f1", "f2"]


SEEDED = {"max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 3}


def solo_outputs(
    engine: EngineActor, prompts: list[list[int]], params: dict[str, Any]
) -> list[Any]:
    sp = SamplingParams(**params)
    reqs = [GenRequest(f"solo{i}", p, sp) for i, p in enumerate(prompts)]
    return [engine.generator.generate([r])[0] for r in reqs]


def test_request_joins_a_running_batch_over_http(engine: EngineActor) -> None:
    """A short request sent while a long one decodes finishes first, both as if alone."""
    long_p, short_p = prompt_ids(engine, "what is 7+8?"), prompt_ids(engine, "1+2=")
    short_params = {**SEEDED, "max_new_tokens": 3}
    solo_long = solo_outputs(engine, [long_p], {**SEEDED, "max_new_tokens": 120})[0]
    solo_short = solo_outputs(engine, [short_p], short_params)[0]

    async def main() -> None:
        async with SGLangClient(engine.url()) as client:
            long_task = asyncio.create_task(
                client.generate(long_p, {**SEEDED, "max_new_tokens": 120}, rid="long")
            )
            while await client.flush_cache():
                await asyncio.sleep(0.002)
            short = await client.generate(short_p, short_params, rid="short")
            assert not long_task.done()
            long = await long_task
        assert short.output_ids == solo_short.output_ids
        assert short.log_probs == pytest.approx(solo_short.output_logprobs, abs=1e-4)
        assert long.output_ids == solo_long.output_ids
        assert long.log_probs == pytest.approx(solo_long.output_logprobs, abs=1e-4)

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_pause_a_weight_update_and_continue_keep_requests(engine: EngineActor, mode: str) -> None:
    """Paused mid-request, the engine takes a new weight version (the same weights, so the
    tokens can be compared with a solo run) and goes on: no token is lost or generated twice,
    and each token reports the version that generated it."""
    prompt = prompt_ids(engine, "12*3=")
    params = {**SEEDED, "max_new_tokens": 120}
    solo = solo_outputs(engine, [prompt], params)[0]

    async def paused_while_running(client: SGLangClient, rid: str) -> asyncio.Task[Any] | None:
        """A request paused mid-generation; None if it finished before the pause arrived
        (a loaded machine can deschedule this test for longer than the generation takes)."""
        task = asyncio.create_task(client.generate(prompt, params, rid=rid))
        while await client.flush_cache():
            await asyncio.sleep(0.002)
        paused = httpx.post(f"{engine.url()}/pause_generation", json={"mode": mode}).json()
        assert paused["status"] == "ok"
        await asyncio.sleep(0.05)  # a response already on its way arrives (~1 ms)
        if task.done():
            httpx.post(f"{engine.url()}/continue_generation", json={})
            return None
        return task

    async def main() -> None:
        async with SGLangClient(engine.url()) as client:
            for attempt in range(ATTEMPTS):
                task = await paused_while_running(client, rid=f"p{attempt}")
                if task is not None:
                    break
            assert task is not None, "the request finished before every pause"
            # in_place keeps the KV cache (flush refused); retract dropped it.
            assert await client.flush_cache() == (mode == "retract")
            before = engine.weight_version()
            updated = httpx.post(f"{engine.url()}/update_weight_version",
                                 json={"new_version": before + 7})
            assert updated.status_code == 200, updated.text
            await asyncio.sleep(0.2)
            assert not task.done()
            httpx.post(f"{engine.url()}/continue_generation", json={})
            out = await task
        assert out.output_ids == solo.output_ids
        assert out.log_probs == pytest.approx(solo.output_logprobs, abs=1e-4)
        old = out.token_versions.count(before)
        assert 0 < old < len(out.output_ids), out.token_versions
        assert out.token_versions == [before] * old + [before + 7] * (len(out.output_ids) - old)
        assert out.weight_version == before + 7

    asyncio.run(main())


def test_pause_abort_returns_partial_and_holds_new_requests(engine: EngineActor) -> None:
    prompt = prompt_ids(engine, "12*3=")
    params = {**SEEDED, "max_new_tokens": 120}

    async def aborted_while_running(client: SGLangClient, rid: str) -> Any:
        """The output of a request aborted mid-generation; None if it finished before the
        pause arrived (120 tokens take ~50 ms here)."""
        task = asyncio.create_task(client.generate(prompt, params, rid=rid))
        while await client.flush_cache():
            await asyncio.sleep(0.002)
        httpx.post(f"{engine.url()}/pause_generation", json={"mode": "abort"})
        first = await task
        if first.aborted:
            return first
        httpx.post(f"{engine.url()}/continue_generation")
        return None

    async def main() -> None:
        async with SGLangClient(engine.url()) as client:
            for attempt in range(ATTEMPTS):
                first = await aborted_while_running(client, rid=f"a{attempt}")
                if first is not None:
                    break
            assert first is not None, "the request finished before every pause"
            held = asyncio.create_task(client.generate(prompt, {**params, "max_new_tokens": 2}))
            await asyncio.sleep(0.2)
            assert not held.done()
            httpx.post(f"{engine.url()}/continue_generation")
            second = await held
        assert first.aborted and 0 < len(first.output_ids) < 120
        assert second.finish_reason == {"type": "length", "length": 2}
        bad = httpx.post(f"{engine.url()}/pause_generation", json={"mode": "nap"})
        assert bad.status_code == 400 and "mode" in bad.json()["error"]["message"]

    asyncio.run(main())


def test_release_resume_over_http_keeps_outputs(engine: EngineActor) -> None:
    prompt = prompt_ids(engine, "3*3=")
    checker = f"{engine.url()}/weights_checker"

    async def generate() -> Any:
        async with SGLangClient(engine.url()) as client:
            return await client.generate(prompt, GREEDY)

    before = asyncio.run(generate())
    checksum = httpx.post(checker, json={"action": "checksum"}).json()["payload"]["checksum"]
    ok = httpx.post(f"{engine.url()}/release_memory_occupation", json={"tags": ["weights"]})
    assert ok.status_code == 200
    assert httpx.post(checker, json={}).status_code == 400
    bad = httpx.post(f"{engine.url()}/resume_memory_occupation", json={"tags": ["gpu"]})
    assert bad.status_code == 400 and "tags" in bad.json()["error"]["message"]
    httpx.post(f"{engine.url()}/resume_memory_occupation", json={})
    assert httpx.post(checker, json={}).json()["payload"]["checksum"] == checksum
    after = asyncio.run(generate())
    assert after.output_ids == before.output_ids and after.log_probs == before.log_probs
    assert httpx.get(f"{engine.url()}/get_weight_version").json() == {"weight_version": "0"}


def test_clients_build_no_certificate_context_for_plain_http():
    """httpx parses the CA bundle for every client by default (~27 ms of CPU); the generation
    loop opens clients every step and the remote reward model one per sample."""
    assert tls_verify("http://127.0.0.1:30000") is False
    context = tls_verify("https://rm.example.com/score")
    assert context is tls_verify("https://other.example.com") and context.verify_mode.name == "CERT_REQUIRED"


def test_a_streamed_batch_answers_each_row_as_it_ends(engine: EngineActor) -> None:
    """`stream: true` on a batch: a chunk per row, in the order the rows end, each naming
    its row and holding what the same batch unstreamed answers; then [DONE]."""
    prompts = [prompt_ids(engine, t) for t in ("12*3=", "7+8=", "40-2=")]
    params = [{**SEEDED, "max_new_tokens": n} for n in (30, 4, 15)]

    async def main() -> tuple[list[Any], list[Any]]:
        async with SGLangClient(engine.url()) as client:
            whole = await client.generate_batch(prompts, params, rids=["a", "b", "c"])
            streamed = [(row, out) async for row, out in client.generate_batch_stream(
                prompts, params, rids=["a2", "b2", "c2"])]
            with pytest.raises(SGLangError, match="Duplicate request ID"):
                async for _ in client.generate_batch_stream(prompts[:2], params[:2],
                                                            rids=["d", "d"]):
                    pass
        return whole, streamed

    whole, streamed = asyncio.run(main())
    assert [row for row, _ in streamed] == [1, 2, 0]  # shortest first
    for row, out in streamed:
        assert out.output_ids == whole[row].output_ids
        assert out.log_probs == whole[row].log_probs
        assert out.token_versions == whole[row].token_versions
