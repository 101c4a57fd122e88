"""Qwen3 and Qwen3-MoE through the embedded engine and the torch trainer's forwards: the
fast decode step with q/k norms (and Qwen2's, with q/k/v biases), the routed experts the
engine records, and their replay."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.gen_types import GenRequest, GenResult, SamplingParams
from engines.inference.kv_decode import HFDecoder, LlamaDecoder
from examples.arithmetic.build_model import save_tiny_model

PROMPTS = ["1+2=", "12*34=?", "a", "what is 7+8? answer:"]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny dense Qwen3 with grouped-query attention (4 query heads, 2 kv heads)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    base = save_tiny_model(str(tmp_path_factory.mktemp("q3") / "base"), 2, 64, family="qwen3")
    config = AutoConfig.from_pretrained(base)
    config.num_key_value_heads = 2
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for layer in model.model.layers:  # norms away from 1, so that a step without them differs
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.data.uniform_(0.5, 1.5)
    out = str(tmp_path_factory.mktemp("q3") / "gqa")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2 (the Qwen2-0.5B shape of the GPU benches, scaled down) with grouped-query
    attention and non-zero q/k/v biases (HF initialises them to zero, which would hide a
    step that drops them)."""
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


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen3-MoE: 2 layers, 8 experts, 2 per token."""
    return save_tiny_model(str(tmp_path_factory.mktemp("q3moe") / "m"), 2, 64, family="qwen3_moe")


@pytest.fixture()
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def requests(gen: EmbeddedGenerator, prompts: list[str], **params: Any) -> list[GenRequest]:
    return [GenRequest(f"r{i}", gen.tokenize(p), SamplingParams(**params))
            for i, p in enumerate(prompts)]


def full_forward_logprobs(model: Any, req: GenRequest, res: GenResult) -> torch.Tensor:
    ids = torch.tensor([req.input_ids + res.output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(req.input_ids)
    return logp[n - 1 : -1].gather(1, torch.tensor(res.output_ids)[:, None])[:, 0]


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_fast_step_matches_hf_generate_and_a_full_forward(
    family: str, request: pytest.FixtureRequest, one_thread: None
) -> None:
    """The lean decode step covers dense Qwen3 (q/k norms per head before RoPE) and Qwen2
    (q/k/v biases): greedy tokens equal HF generate's on a left-padded batch, sampled
    log-probs a full forward's."""
    gen = EmbeddedGenerator(request.getfixturevalue(f"{family}_dir"), num_threads=1, device="cpu")
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
    gen._decoder = HFDecoder(gen.model)  # the same numbers as the HF forward's step
    slow = gen.generate(reqs)
    assert [r.output_ids for r in slow] == [r.output_ids for r in fast]


def _experts_seen(model: Any) -> tuple[list[torch.Tensor], list[Any]]:
    """The top-k ids each layer's experts are run with, per forward (pre-hooks on them)."""
    seen: list[torch.Tensor] = []
    handles = [layer.mlp.experts.register_forward_pre_hook(
        lambda m, args: seen.append(args[1].clone())) for layer in model.model.layers]
    return seen, handles


def test_the_engine_records_the_experts_its_forwards_used(moe_dir: str, one_thread: None) -> None:
    """Per request, SGLang's shape: the routing of every token fed to the model (prompt +
    output - 1 tokens x layers x top-k), equal to one full forward's over those tokens;
    given only to requests that ask."""
    gen = EmbeddedGenerator(moe_dir, num_threads=1, device="cpu")
    assert isinstance(gen._decoder, HFDecoder) and gen._routing is not None
    params = SamplingParams(max_new_tokens=10, ignore_eos=True, sampling_seed=3)
    reqs = [GenRequest(f"r{i}", gen.tokenize(p), params, return_routed_experts=i != 3)
            for i, p in enumerate(PROMPTS)]
    results = gen.generate(reqs)
    assert results[3].routed_experts is None
    model: Any = gen.model
    for req, res in zip(reqs[:3], results[:3], strict=True):
        tokens = req.input_ids + res.output_ids
        assert res.routed_experts is not None and res.routed_experts.dtype == np.int16
        recorded = torch.from_numpy(res.routed_experts).reshape(len(tokens) - 1, 2, 2)
        seen, handles = _experts_seen(model)
        with torch.no_grad():
            model(torch.tensor([tokens[:-1]]))
        for h in handles:
            h.remove()
        for layer in range(2):
            assert torch.equal(recorded[:, layer].long(), seen[layer]), layer
        expected = full_forward_logprobs(model, req, res)
        assert (expected - torch.tensor(res.output_logprobs)).abs().max().item() < 1e-5


def test_a_replayed_forward_routes_to_the_recorded_experts(moe_dir: str, one_thread: None) -> None:
    """With the router's weights moved (a trainer a few updates on, other numerics), plain
    forwards pick other experts than the engine did; the replayed forward runs exactly the
    recorded ones, on every token but the last, with weights from the trainer's router (the
    router still gets a gradient)."""
    from dataclasses import replace

    from engines.train.routing_replay import RoutingReplayError, build_replay_batch
    from engines.train.torch_models import response_outputs
    from storage.sample import RoutedExperts, Sample

    gen = EmbeddedGenerator(moe_dir, num_threads=1, device="cpu")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, sampling_seed=11)
    reqs = [GenRequest(f"r{i}", gen.tokenize(p), params, return_routed_experts=True)
            for i, p in enumerate(PROMPTS)]
    samples = []
    for i, (req, res) in enumerate(zip(reqs, gen.generate(reqs), strict=True)):
        assert res.routed_experts is not None
        samples.append(Sample(index=i, group_index=0, tokens=req.input_ids + res.output_ids,
                              response_length=len(res.output_ids),
                              loss_mask=[1] * len(res.output_ids),
                              routed_experts=RoutedExperts.of(res.routed_experts)))
    from transformers import AutoModelForCausalLM

    trainer: Any = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in trainer.model.layers:
            layer.mlp.gate.weight.add_(torch.randn_like(layer.mlp.gate.weight) * 0.05)
    batch = build_replay_batch(samples, 0, (2, 2))
    assert batch.routed_experts is not None and batch.routed_experts.shape[2:] == (2, 2)
    lengths = [len(s.tokens) for s in samples]
    real = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
    for b, n in enumerate(lengths):
        real[b, : n - 1] = True  # every recorded token

    def experts_of(b: Any) -> list[torch.Tensor]:
        seen, handles = _experts_seen(trainer)
        log_probs, _, aux = response_outputs(trainer, b, 1.0, router_aux_loss=True)
        for h in handles:
            h.remove()
        assert aux is not None and aux.requires_grad
        log_probs.sum().backward()
        return [ids.reshape(*real.shape, 2)[real] for ids in seen]

    recorded = [batch.routed_experts[:, :, layer][real] for layer in range(2)]
    replayed = experts_of(batch)
    assert all(torch.equal(r, e) for r, e in zip(replayed, recorded, strict=True))
    assert trainer.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    own = experts_of(replace(batch, routed_experts=None))
    assert any(not torch.equal(o.sort(-1).values, e.sort(-1).values)
               for o, e in zip(own, recorded, strict=True))
    samples[1].routed_experts = None
    with pytest.raises(RoutingReplayError, match=r"^sample 1: algorithm.routing_replay needs"):
        build_replay_batch(samples, 0, (2, 2))


def test_routed_experts_cross_the_wire_as_sglang_encodes_them() -> None:
    """meta_info.routed_experts is base64 of int32 (SGLang's encoding); the client reads it
    back exactly, and asks for it only when told to."""
    from engines.inference.sglang_protocol import to_response
    from engines.rollout.sglang_client import generate_body, parse_output
    from storage.sample import RoutedExperts

    ids = np.array([0, 7, -1, -1, 5, 300], dtype=np.int16)
    result = GenResult("r", [4, 5], [-0.5, -0.25], "ab", {"type": "length"}, 2, 0, ids)
    answer = to_response(result, True, 0.1)
    assert np.frombuffer(__import__("base64").b64decode(answer["meta_info"]["routed_experts"]),
                         dtype="<i4").tolist() == ids.tolist()
    assert parse_output(answer).routed_experts == RoutedExperts.of(ids)
    assert "routed_experts" not in to_response(GenResult("r", [4], [-0.5], "a", {}, 2, 0), True, 0)["meta_info"]
    assert generate_body([1], {}, None, True, return_routed_experts=True)["return_routed_experts"]
    assert "return_routed_experts" not in generate_body([1], {}, None, True)
