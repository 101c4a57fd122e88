"""The GPU decode turn (`cuda_graph_decode`), run eagerly on the CPU: the step a CUDA graph
captures (column a device tensor, attention over every cache column, sampling inside) and
the turn around it (cut at the first finish, columns after it un-marked) give what one
Python step at a time gives. Graph capture and replay themselves: tests/gpu/."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engines.inference.cuda_graph_decode import CudaGraphTurns, _steps_kept
from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.gen_types import GenRequest, SamplingParams
from engines.inference.kv_cache import RowFinish
from engines.inference.kv_decode import LlamaDecoder
from tests.unit.test_continuous_decode_steps import PROMPTS, mixed_requests, outputs
from tests.unit.test_qwen3_models import qwen2_dir, qwen3_dir  # noqa: F401 (fixtures)


def python_step(gen: EmbeddedGenerator) -> EmbeddedGenerator:
    """`gen` decoding one token a turn through the Python step (the reference)."""
    gen._decoder = LlamaDecoder(gen.model, use_fused=False)
    gen._graphs = None
    gen.continuous_steps = 1
    return gen


def graph_turns(gen: EmbeddedGenerator, steps: int = 8) -> EmbeddedGenerator:
    """`gen` decoding `steps` tokens a turn through the graph's step, run eagerly."""
    decoder = LlamaDecoder(gen.model, use_fused=False)
    gen._decoder, gen._graphs = decoder, CudaGraphTurns(decoder, capture=False)
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
    from engines.inference.config import EngineConfig
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
