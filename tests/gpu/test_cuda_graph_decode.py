"""The embedded engine's CUDA-graph decode turns on a GPU (`cuda_graph_decode`): the same
tokens, finishes and log-probs as the eager step, greedy equal to HF `generate` (float32),
and a weight update reaching the next replay (the graph is captured again)."""

from __future__ import annotations

import pytest
import torch

from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.gen_types import GenRequest, SamplingParams
from tests.unit.test_continuous_decode_steps import PROMPTS, mixed_requests, outputs
from tests.unit.test_qwen3_models import qwen2_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


def engine(path: str, graphs: bool, compiled: bool = False) -> EmbeddedGenerator:
    gen = EmbeddedGenerator(path, device="cuda", cuda_graph=graphs, continuous_steps=8,
                            torch_compile=compiled)
    assert (gen._graphs is not None) == graphs
    return gen


@pytest.mark.parametrize("compiled", [False, True])
def test_graph_turns_equal_the_eager_step_and_hf_generate(
    qwen2_dir: str, compiled: bool  # noqa: F811
) -> None:
    """float32; `compiled`: the captured layers through torch.compile (fused kernels sum in
    another order: log-probs within 1e-5, tokens still equal on this model)."""
    eager, graphed = engine(qwen2_dir, False), engine(qwen2_dir, True, compiled)
    stop = eager.generate(mixed_requests(eager))[1].output_ids[3]
    reqs = mixed_requests(eager, stop_token=stop)
    want, got = eager.generate(reqs), graphed.generate(reqs)
    assert {r.finish_reason["type"] for r in want} == {"length", "stop"}
    assert outputs(got) == outputs(want)
    for a, b in zip(got, want, strict=True):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-5)
    assert graphed._graphs is not None and graphed._graphs.captures > 0
    assert (graphed._decoder._layer_fn.__name__ == "layer") == compiled  # (not fallen back)

    ids = [graphed.tokenize(p) for p in PROMPTS]
    width = max(map(len, ids))
    padded = torch.tensor([[0] * (width - len(x)) + x for x in ids], device="cuda")
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device="cuda")
    with torch.inference_mode():
        ref = graphed.model.generate(
            input_ids=padded, attention_mask=mask, do_sample=False, temperature=None,
            top_p=None, top_k=None, max_new_tokens=40, min_new_tokens=40, pad_token_id=0,
        )  # fmt: skip
    greedy = graphed.generate([GenRequest(f"g{i}", x, SamplingParams(
        temperature=0.0, max_new_tokens=40, ignore_eos=True)) for i, x in enumerate(ids)])
    assert [r.output_ids for r in greedy] == [row[width:] for row in ref.tolist()]


def test_a_weight_update_is_replayed(qwen2_dir: str) -> None:  # noqa: F811
    """In-place weight updates between generates (as a rollout step's push) are read by the
    next turn's graph, captured again over the new gathered weights."""
    graphed = engine(qwen2_dir, True)
    req = [GenRequest("a", graphed.tokenize(PROMPTS[3]),
                      SamplingParams(max_new_tokens=32, temperature=0.0, ignore_eos=True))]
    before = graphed.generate(req)[0].output_ids
    assert graphed._graphs is not None
    captured = graphed._graphs.captures
    torch.manual_seed(3)
    noisy = [(n, t + 0.5 * torch.randn_like(t)) for n, t in graphed.model.state_dict().items()]
    graphed.load_weights(noisy, 1)
    after = graphed.generate(req)[0].output_ids
    fresh = engine(qwen2_dir, False)
    fresh.load_weights(noisy, 1)
    assert after == fresh.generate(req)[0].output_ids != before
    assert graphed._graphs.captures > captured


def test_a_reservation_capped_by_free_memory_is_captured_again_as_it_grows(
    qwen2_dir: str,  # noqa: F811
) -> None:
    """The probe reads the GPU's free memory; with none free (a figure passed in) a turn
    that grows the cache reserves its own steps only, so the cache grows again and the
    graph is captured again, with the eager step's tokens and finishes."""
    from engines.inference.cuda_graph_decode import device_free_bytes

    free = device_free_bytes(torch.device("cuda"))
    assert free is not None and 0 < free <= torch.cuda.mem_get_info()[1]
    eager, graphed, capped = (engine(qwen2_dir, g) for g in (False, True, True))
    assert graphed._graphs is not None and capped._graphs is not None
    capped._graphs.free_bytes = lambda device: 0
    reqs = [GenRequest(f"r{i}", eager.tokenize(p), SamplingParams(
        max_new_tokens=90 + 20 * i, temperature=(0.0, 1.0)[i % 2], ignore_eos=True,
        sampling_seed=i)) for i, p in enumerate(PROMPTS)]  # fmt: skip
    for gen in (eager, graphed, capped):
        gen.context_len = 512  # (the model's 128 positions leave the cache little to grow)
    want = outputs(eager.generate(reqs))
    assert outputs(graphed.generate(reqs)) == want
    assert outputs(capped.generate(reqs)) == want
    assert capped._graphs.captures > graphed._graphs.captures


def test_a_batch_of_the_same_shape_replays_the_graph_after_cublas_workspaces_are_freed(
    qwen2_dir: str,  # noqa: F811
) -> None:
    """A second batch of the same shape replays the first one's graph (`adopt`), also after
    something else in the process freed cuBLAS's workspaces and emptied the cache (as
    torch.compile's CUDA graph trees do, e.g. HF's static-cache generate): the graph owns
    the workspace its matmuls use."""
    graphed = engine(qwen2_dir, True)
    reqs = [GenRequest(f"r{i}", graphed.tokenize(p), SamplingParams(
        max_new_tokens=24, temperature=(0.0, 1.0)[i % 2], ignore_eos=True, sampling_seed=i))
        for i, p in enumerate(PROMPTS)]  # fmt: skip
    first = outputs(graphed.generate(reqs))
    assert graphed._graphs is not None and graphed._graphs.adoptions == 0
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    assert outputs(graphed.generate(reqs)) == first
    assert graphed._graphs.adoptions == 1
    torch.cuda.synchronize()
