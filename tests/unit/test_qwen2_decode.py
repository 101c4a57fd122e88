"""Qwen2 (Llama with q/k/v biases; the Qwen2-0.5B shape of the GPU benches) through the
embedded engine's lean decode step: greedy tokens equal HF generate's, sampled log-probs a
full forward's, and the HF-forward fallback gives the same tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.kv_decode import HFDecoder, LlamaDecoder
from tests.unit.test_qwen3_models import PROMPTS, full_forward_logprobs, one_thread, requests

__all__ = ["one_thread"]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2 with grouped-query attention and non-zero q/k/v biases (HF initialises
    them to zero, which would hide a step that drops them)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from examples.arithmetic.build_model import build_tokenizer

    tok = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         tie_word_embeddings=True)
    torch.manual_seed(2)
    model = Qwen2ForCausalLM(config)
    for layer in model.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias.data.uniform_(-0.5, 0.5)
    out = str(tmp_path_factory.mktemp("q2"))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_qwen2_fast_step_matches_hf_generate_and_a_full_forward(
    qwen2_dir: str, one_thread: None  # noqa: F811
) -> None:
    gen = EmbeddedGenerator(qwen2_dir, num_threads=1, device="cpu")
    assert isinstance(gen._decoder, LlamaDecoder)
    ids = [gen.tokenize(p) for p in PROMPTS]
    width = max(map(len, ids))
    padded = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    model: Any = gen.model
    with torch.inference_mode():
        ref = model.generate(
            input_ids=padded, attention_mask=mask, do_sample=False, temperature=None,
            top_p=None, top_k=None, max_new_tokens=30, min_new_tokens=30, pad_token_id=0,
        )  # fmt: skip
    greedy = gen.generate(requests(gen, PROMPTS, temperature=0.0, max_new_tokens=30,
                                   ignore_eos=True))
    assert [r.output_ids for r in greedy] == [row[width:] for row in ref.tolist()]
    reqs = requests(gen, PROMPTS, max_new_tokens=24, ignore_eos=True, sampling_seed=5)
    fast = gen.generate(reqs)
    for req, res in zip(reqs, fast, strict=True):
        expected = full_forward_logprobs(model, req, res)
        assert (expected - torch.tensor(res.output_logprobs)).abs().max().item() < 1e-5
    gen._decoder = HFDecoder(gen.model)
    slow = gen.generate(reqs)
    assert [r.output_ids for r in slow] == [r.output_ids for r in fast]
