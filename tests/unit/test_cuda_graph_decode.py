"""The GPU decode turn (`cuda_graph_decode`), run eagerly on the CPU: the step a CUDA graph
captures (column a device tensor, attention over every cache column, sampling inside) and
the turn around it (cut at the first finish, columns after it un-marked) give what one
Python step at a time gives. Graph capture and replay themselves: tests/gpu/."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engines.inference.cuda_graph_decode import (
    CudaGraphTurns,
    FreeBytes,
    _capacity,
    _steps_kept,
    device_free_bytes,
)
from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.gen_types import GenRequest, SamplingParams
from engines.inference.kv_cache import KVCache, RowFinish
from engines.inference.kv_decode import LlamaDecoder
from tests.unit.test_continuous_decode_steps import PROMPTS, mixed_requests, outputs
from tests.unit.test_qwen3_models import qwen2_dir, qwen3_dir  # noqa: F401 (fixtures)


def python_step(gen: EmbeddedGenerator) -> EmbeddedGenerator:
    """`gen` decoding one token a turn through the Python step (the reference)."""
    gen._decoder = LlamaDecoder(gen.model, use_fused=False)
    gen._graphs = None
    gen.continuous_steps = 1
    return gen


def graph_turns(
    gen: EmbeddedGenerator, steps: int = 8, free_bytes: FreeBytes = device_free_bytes
) -> EmbeddedGenerator:
    """`gen` decoding `steps` tokens a turn through the graph's step, run eagerly
    (`free_bytes`: the device memory its cache may grow into)."""
    decoder = LlamaDecoder(gen.model, use_fused=False)
    gen._decoder = decoder
    gen._graphs = CudaGraphTurns(decoder, capture=False, free_bytes=free_bytes)
    gen.continuous_steps = steps
    return gen


@pytest.fixture()
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_graph_turns_give_what_python_steps_give(
    family: str, request: pytest.FixtureRequest, one_thread: None
) -> None:
    """Greedy and sampled rows, budgets 5..35, a stop token some rows draw: same tokens,
    finishes, and log-probs within 1e-5, with 8 tokens a turn."""
    path = request.getfixturevalue("tiny_model_dir" if family == "llama" else f"{family}_dir")
    gen = EmbeddedGenerator(path, num_threads=1, device="cpu")
    reference = python_step(gen)
    stop = reference.generate(mixed_requests(gen))[1].output_ids[3]
    reqs = mixed_requests(gen, stop_token=stop)
    one = reference.generate(reqs)
    assert {r.finish_reason["type"] for r in one} == {"length", "stop"}
    several = graph_turns(gen).generate(reqs)
    assert outputs(several) == outputs(one)
    for a, b in zip(several, one, strict=True):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)


def test_a_batch_of_the_same_shape_adopts_the_last_batchs_graph(
    qwen2_dir: str, one_thread: None  # noqa: F811
) -> None:
    """A second batch of the same rows and budgets moves its cache into the buffers the
    graph reads instead of capturing again, and gives what one Python step at a time gives;
    a batch of another size does not."""
    gen = EmbeddedGenerator(qwen2_dir, num_threads=1, device="cpu")

    def batch(prompts: list[str]) -> list[GenRequest]:
        return [GenRequest(f"r{i}", gen.tokenize(p), SamplingParams(
            max_new_tokens=20, temperature=(0.0, 1.0)[i % 2], ignore_eos=True,
            sampling_seed=i)) for i, p in enumerate(prompts)]  # fmt: skip

    first, second = batch(PROMPTS), batch(PROMPTS[::-1])  # (other prompts, same widths)
    reference = python_step(gen)
    want = [outputs(reference.generate(reqs)) for reqs in (first, second)]
    turns = graph_turns(EmbeddedGenerator(qwen2_dir, num_threads=1, device="cpu"))
    assert turns._graphs is not None
    assert outputs(turns.generate(first)) == want[0]
    adopted = turns._graphs.adoptions
    assert outputs(turns.generate(second)) == want[1]
    assert turns._graphs.adoptions == adopted + 1
    turns.generate(first[:3])
    assert turns._graphs.adoptions == adopted + 1


def test_a_cut_turn_leaves_no_marked_column_past_the_cache_width(
    tiny_model_dir: str, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A turn that ends early (a row drew its stop token) wrote columns for steps it then
    dropped: they are un-marked, so the next turn's attention does not read them; rows with
    stop strings go a token a turn."""
    from engines.inference import cuda_graph_decode

    cuts: list[tuple[int, int]] = []

    def watched(tokens: torch.Tensor, finish: RowFinish) -> int:
        kept = _steps_kept(tokens, finish)
        cuts.append((kept, tokens.shape[0]))
        return kept

    monkeypatch.setattr(cuda_graph_decode, "_steps_kept", watched)
    gen = graph_turns(EmbeddedGenerator(tiny_model_dir, num_threads=1, device="cpu"))
    stop = gen.generate(mixed_requests(gen))[1].output_ids[3]
    batch = gen.new_batch()
    gen.step(batch, mixed_requests(gen, stop_token=stop))
    while batch.num_running:
        gen.step(batch, [])
        if batch.cache is not None:
            assert not batch.cache.mask[:, batch.cache.width :].any()
    assert any(kept < steps for kept, steps in cuts)
    stops = [GenRequest(f"s{i}", gen.tokenize(p), SamplingParams(
        max_new_tokens=6, ignore_eos=True, sampling_seed=i, stop=("zz",)))
        for i, p in enumerate(PROMPTS)]  # fmt: skip
    batch = gen.new_batch()
    gen.step(batch, stops)
    while batch.num_running:
        live = [batch.rows[j] for j in batch.live_rows()]
        before = [len(s.out_ids) for s in live]
        gen.step(batch, [])
        assert [len(s.out_ids) - n for s, n in zip(live, before, strict=True)] == [1] * len(live)


def test_steps_kept_stop_at_the_first_live_finish() -> None:
    """Row 0 (live) draws its stop token at step 2; row 1 is dead and draws one at step 0
    (ignored); row 2's budget ends at step 3."""
    tokens = torch.tensor([[5, 9, 1], [6, 1, 1], [9, 1, 1], [1, 1, 1]])
    finish = RowFinish(live=torch.tensor([True, False, True]), left=torch.tensor([10, 10, 4]),
                       stop_ids=torch.tensor([[9, -1], [5, -1], [7, 8]]),
                       fewest_left=4, most_left=10)
    assert _steps_kept(tokens, finish) == 3
    assert _steps_kept(tokens[:2], finish) == 2  # no live finish in two steps: both kept
    finish = RowFinish(torch.tensor([True, False, True]), torch.tensor([10, 10, 2]),
                       torch.full((3, 1), -1), 2)
    assert _steps_kept(tokens, finish) == 2


def test_a_weight_update_between_turns_is_used_by_the_next_turn(
    tiny_model_dir: str, one_thread: None
) -> None:
    """The turn's step reads gathered weights (fused q|k|v): after an in-place update the
    next turn must see the new weights, as a fresh engine with them does."""
    gen = graph_turns(EmbeddedGenerator(tiny_model_dir, num_threads=1, device="cpu"))
    req = [GenRequest("a", gen.tokenize(PROMPTS[3]),
                      SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))]
    before = gen.generate(req)[0].output_ids
    torch.manual_seed(3)
    noisy = [(n, t + 0.5 * torch.randn_like(t)) for n, t in gen.model.state_dict().items()]
    gen.load_weights(noisy, 1)
    after = gen.generate(req)[0].output_ids
    fresh = graph_turns(EmbeddedGenerator(tiny_model_dir, num_threads=1, device="cpu"))
    fresh.load_weights(noisy, 1)
    assert after == fresh.generate(req)[0].output_ids
    assert after != before


def test_the_gpu_engine_takes_graph_turns_unless_disabled(tiny_model_dir: str) -> None:
    """On a CPU the engine keeps its compiled step; `engine.disable_cuda_graph` is passed."""
    from engines.config.engine import EngineConfig
    from engines.inference.engine_actor import GENERATOR_BACKENDS

    gen = EmbeddedGenerator(tiny_model_dir, num_threads=1, device="cpu")
    assert gen._graphs is None
    config = EngineConfig(backend="embedded", model_path=tiny_model_dir, disable_cuda_graph=True)
    generator = GENERATOR_BACKENDS["embedded"](config, 0, 1)
    assert isinstance(generator, EmbeddedGenerator) and not generator.cuda_graph


def test_a_failed_compile_falls_back_to_the_eager_layer(
    tiny_model_dir: str, one_thread: None, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`engine.enable_torch_compile` where the compiler fails (no triton, a new op): one
    warning, then the same outputs from the eager layers."""
    from engines.inference import kv_decode

    calls: list[int] = []

    def broken(*args: object) -> torch.Tensor:
        calls.append(1)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(kv_decode, "_compiled_layer", lambda: broken)
    gen = graph_turns(EmbeddedGenerator(tiny_model_dir, num_threads=1, device="cpu"))
    want = gen.generate(mixed_requests(gen))
    assert gen._graphs is not None
    gen._graphs.decoder.compile_layers()
    got = gen.generate(mixed_requests(gen))
    assert outputs(got) == outputs(want) and calls == [1]
    assert "torch.compile failed" in caplog.text


def test_a_turn_reserves_ahead_what_the_free_memory_holds() -> None:
    """A 7B-class model's cache (32 layers, 8 KV heads of 128 dims, bf16) at 256 rows costs
    32 MiB a column, so the 2,048 columns a long budget asks for ahead would be 64 GiB. A
    turn reserves what 90% of the free memory holds, beside the old buffers (freed a layer
    at a time as they are copied); with none free, its own steps; off a GPU (no figure) or
    with plenty free, the whole budget. Within its capacity it probes nothing."""
    rows, width = 256, 124
    layers = [torch.empty(rows, 8, 2, 128, 128, dtype=torch.bfloat16, device="meta")
              for _ in range(32)]  # fmt: skip
    cache = KVCache(layers, torch.empty(rows, 128, dtype=torch.bool, device="meta"), width)
    assert cache.column_bytes == 32 * (rows * 8 * 2 * 128 * 2) + rows  # 128 KiB a token

    def free(figure: int | None) -> FreeBytes:
        return lambda device: figure

    whole = 2176  # width + 2,048, rounded up to 64
    assert _capacity(cache, 8, 2048, free(None)) == whole
    assert _capacity(cache, 8, 2048, free(1 << 50)) == whole
    # 36 GiB holds 1,151 columns, and 124 of the old 128 are freed as they are copied
    assert _capacity(cache, 8, 2048, free(40 << 30)) == (1151 + 124) // 64 * 64
    assert _capacity(cache, 8, 2048, free(0)) == 192  # width + 8 steps, rounded up

    def unasked(device: torch.device) -> int:
        raise AssertionError("probed for a turn within the capacity")

    assert _capacity(cache, 4, 4, unasked) == 128


def test_a_capped_reservation_grows_again_and_gives_what_python_steps_give(
    tiny_model_dir: str, one_thread: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no free memory a turn that grows the cache reserves its own steps only, so the
    cache grows again at later turns, and the tokens, finishes and log-probs are still
    those of one Python step at a time; with plenty free, every turn reserves what it does
    off a GPU (the longest budget left)."""
    gen = EmbeddedGenerator(tiny_model_dir, num_threads=1, device="cpu")
    gen.context_len = 512  # (the tiny model's 128 positions leave the cache little to grow)

    def requests(stop: int | None = None) -> list[GenRequest]:
        return [GenRequest(f"r{i}", gen.tokenize(p), SamplingParams(
            max_new_tokens=90 + 20 * i, temperature=(0.0, 1.0, 0.6, 1.3)[i % 4],
            ignore_eos=True, sampling_seed=i, stop_token_ids=() if stop is None else (stop,)))
            for i, p in enumerate(PROMPTS)]  # fmt: skip

    reference = python_step(gen)
    stop = reference.generate(requests())[1].output_ids[3]
    one = reference.generate(requests(stop))
    assert {r.finish_reason["type"] for r in one} == {"length", "stop"}

    def reserved(figure: int | None) -> list[tuple[int, int, int, int]]:
        """Each turn's cache width and capacity before it, its steps, capacity after."""
        graph_turns(gen, free_bytes=lambda device: figure)
        assert gen._graphs is not None
        decode, seen = gen._graphs.decode_steps, []

        def watched(tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                    steps: int, *rest: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
            before = (cache.width, cache.capacity)
            out = decode(tokens, positions, cache, steps, *rest)
            seen.append((*before, steps, cache.capacity))
            return out

        monkeypatch.setattr(gen._graphs, "decode_steps", watched)
        got = gen.generate(requests(stop))
        assert outputs(got) == outputs(one)
        for a, b in zip(got, one, strict=True):
            assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
        return seen

    def grew(turns: list[tuple[int, int, int, int]]) -> list[tuple[int, int, int]]:
        return [(width, steps, after) for width, before, steps, after in turns if after > before]

    def own_steps(width: int, steps: int) -> int:
        return -(-(width + steps) // 64) * 64

    capped, unprobed = grew(reserved(0)), grew(reserved(None))
    assert len(capped) > 1 and all(after == own_steps(w, s) for w, s, after in capped)
    assert any(after > own_steps(w, s) for w, s, after in unprobed)
    assert grew(reserved(1 << 50)) == unprobed
