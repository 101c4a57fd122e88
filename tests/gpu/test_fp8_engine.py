"""FP8 rollouts on a GPU (`engine.dtype: fp8`): the embedded engine's float8 projections run
`torch._scaled_mm` inside its CUDA-graph decode turns. Its log-probs are its own full
forward's (within bfloat16's rounding), the graph turns give the eager step's tokens, a
weight update is quantized again and reaches the next replay, and the gap to a bfloat16
trainer's log-probs stays small. The CPU version: tests/unit/test_fp8_engine.py; throughput
and the gap on the 0.5B shape: `bench.generation --device cuda --fp8`."""

from __future__ import annotations

import pytest
import torch

from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.fp8 import FP8
from engines.inference.kv_decode import TRITON_SWITCH
from tests.unit.test_continuous_decode_steps import mixed_requests, outputs
from tests.unit.test_qwen3_models import qwen2_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


def _gap(gen: EmbeddedGenerator, model: torch.nn.Module, reqs: list, results: list) -> float:
    """Largest |engine log-prob - `model`'s full-forward log-prob| over the sampled tokens."""
    worst = 0.0
    for req, res in zip(reqs, results, strict=True):
        ids = torch.tensor([req.input_ids + res.output_ids], device="cuda")
        n = len(req.input_ids)
        temperature = req.params.temperature or 1.0  # log-probs of the tempered distribution
        with torch.inference_mode():
            logits = model(ids).logits[0, n - 1 : -1].float() / temperature
            logp = torch.log_softmax(logits, -1)
        ref = logp.gather(1, torch.tensor(res.output_ids, device="cuda")[:, None])[:, 0].cpu()
        worst = max(worst, float((ref - torch.tensor(res.output_logprobs)).abs().max()))
    return worst


def test_fp8_graph_turns_are_the_models_own_forward(
    qwen2_dir: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """The graph of the eager ops gives the eager step's tokens; the default graph, through
    `triton_decode`'s kernels (float32 attention scores, which the eager ops round to
    bfloat16), the model's own log-probs."""
    eager = EmbeddedGenerator(qwen2_dir, dtype="fp8", device="cuda", cuda_graph=False,
                              continuous_steps=8)
    monkeypatch.setenv(TRITON_SWITCH, "0")
    plain = EmbeddedGenerator(qwen2_dir, dtype="fp8", device="cuda", continuous_steps=8)
    monkeypatch.delenv(TRITON_SWITCH)
    graphed = EmbeddedGenerator(qwen2_dir, dtype="fp8", device="cuda", continuous_steps=8)
    assert graphed.model.model.layers[0].mlp.up_proj.weight.dtype == FP8
    assert graphed._decoder.triton and not plain._decoder.triton
    reqs = mixed_requests(graphed)
    want, got = eager.generate(reqs), graphed.generate(reqs)
    assert outputs(plain.generate(reqs)) == outputs(want)
    assert graphed._graphs is not None and graphed._graphs.captures > 0
    assert plain._graphs is not None and plain._graphs.captures > 0
    assert _gap(graphed, graphed.model, reqs, got) < 0.05  # bf16 activations between matmuls
    bf16 = EmbeddedGenerator(qwen2_dir, dtype="bfloat16", device="cuda").model
    assert _gap(graphed, bf16, reqs, got) < 0.25  # what a bf16 trainer would see

    state = {k: 1.5 * v for k, v in bf16.state_dict().items()}
    graphed.update_weights(state, version=1)
    after = graphed.generate(reqs)
    assert outputs(after) != outputs(got)
    assert _gap(graphed, graphed.model, reqs, after) < 0.05  # the new weights, recaptured
