"""The embedded generator against the model it wraps: log-probs, sampling, stops, abort."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.gen_types import GenRequest, GenResult, SamplingParams
from engines.inference.kv_decode import HFDecoder, LlamaDecoder
from engines.inference.mock_generator import MockGenerator
from engines.weights.sync import weights_checksum
from examples.arithmetic.build_model import save_tiny_model

PROMPTS = ["1+2=", "12*34=?", "a", "what is 7+8? answer:"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("gen") / "tiny"))


@pytest.fixture()
def gen(model_dir: str) -> Iterator[EmbeddedGenerator]:
    """One torch thread: tiny batches on a shared 2-core box run faster without OpenMP."""
    threads = torch.get_num_threads()
    yield EmbeddedGenerator(model_dir, num_threads=1, device="cpu")  # CPU-exact references
    torch.set_num_threads(threads)


def requests(gen: EmbeddedGenerator, prompts: list[str], **params: object) -> list[GenRequest]:
    return [
        GenRequest(f"r{i}", gen.tokenize(p), SamplingParams(**params))  # type: ignore[arg-type]
        for i, p in enumerate(prompts)
    ]


def full_forward_logprobs(
    gen: EmbeddedGenerator, req: GenRequest, res: GenResult, temperature: float
) -> torch.Tensor:
    ids = torch.tensor([req.input_ids + res.output_ids])
    with torch.no_grad():
        logits = gen.model(ids).logits[0].float() / temperature
    n = len(req.input_ids)
    logp = torch.log_softmax(logits[n - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(res.output_ids)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_sequence_forward(gen: EmbeddedGenerator, temperature: float) -> None:
    reqs = requests(
        gen, PROMPTS, temperature=temperature, max_new_tokens=12, ignore_eos=True, sampling_seed=3
    )
    results = gen.generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert len(res.output_ids) == len(res.output_logprobs) == 12
        expected = full_forward_logprobs(gen, req, res, temperature)
        assert (expected - torch.tensor(res.output_logprobs)).abs().max().item() < 1e-5


def test_truncation_does_not_change_reported_logprobs(gen: EmbeddedGenerator) -> None:
    greedy = gen.generate(requests(gen, PROMPTS, temperature=0.0, max_new_tokens=6))
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        reqs = requests(gen, PROMPTS, max_new_tokens=6, sampling_seed=1, **params)
        for req, g, res in zip(reqs, greedy, gen.generate(reqs), strict=True):
            assert res.output_ids == g.output_ids
            expected = full_forward_logprobs(gen, req, res, 1.0)
            assert torch.allclose(torch.tensor(res.output_logprobs), expected, atol=1e-5)
            assert max(res.output_logprobs) < -0.1


def test_greedy_equals_hf_generate(gen: EmbeddedGenerator) -> None:
    """Token for token what HF `generate` gives the same left-padded batch."""
    ids = [gen.tokenize(p) for p in PROMPTS]
    width = max(map(len, ids))
    padded = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    model: Any = gen.model
    with torch.inference_mode():
        ref = model.generate(
            input_ids=padded, attention_mask=mask, do_sample=False, temperature=None,
            top_p=None, top_k=None, max_new_tokens=40, min_new_tokens=40, pad_token_id=0,
        )  # fmt: skip
    res = gen.generate(requests(gen, PROMPTS, temperature=0.0, max_new_tokens=40, ignore_eos=True))
    assert [r.output_ids for r in res] == [row[width:] for row in ref.tolist()]


def test_fallback_decoder_matches_the_fast_path(gen: EmbeddedGenerator) -> None:
    """The HF-forward decoder (models without a fast path) gives the same tokens and
    log-probs, across cache growth (80 tokens > the first reservation) and a late joiner."""

    def run() -> dict[str, GenResult]:
        kw = {"max_new_tokens": 80, "ignore_eos": True, "sampling_seed": 7}
        reqs = requests(gen, PROMPTS[:3], **kw)
        late = GenRequest("late", gen.tokenize(PROMPTS[3]), SamplingParams(**kw))  # type: ignore[arg-type]
        batch, done = gen.new_batch(), dict[str, GenResult]()
        done.update((r.rid, r) for r in gen.step(batch, reqs))
        for _ in range(3):
            done.update((r.rid, r) for r in gen.step(batch, []))
        done.update((r.rid, r) for r in gen.step(batch, [late]))
        _drain(gen, batch, done)
        return done

    assert isinstance(gen._decoder, LlamaDecoder)
    fast = run()
    gen._decoder = HFDecoder(gen.model)
    slow = run()
    assert fast.keys() == slow.keys() and len(fast) == 4
    for rid, res in fast.items():
        assert len(res.output_ids) == 80 and res.output_ids == slow[rid].output_ids
        assert res.output_logprobs == pytest.approx(slow[rid].output_logprobs, abs=1e-5)


@pytest.fixture(scope="module")
def gqa_model_dir(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model's layout with 2 kv heads for its 4 query heads (grouped-query
    attention, as Llama 3 and Qwen 2), saved and loaded the way users' models are."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    config.num_key_value_heads = 2
    torch.manual_seed(1)
    out = str(tmp_path_factory.mktemp("gqa") / "tiny-gqa")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def test_grouped_query_attention_matches_hf_and_a_full_forward(gqa_model_dir: str) -> None:
    """The fast path's attention serves each kv head's group of query heads as HF's
    `repeat_kv` does: greedy tokens equal HF generate's, sampled log-probs a full forward's."""
    gqa = EmbeddedGenerator(gqa_model_dir, num_threads=1, device="cpu")
    assert isinstance(gqa._decoder, LlamaDecoder) and gqa.model.config.num_key_value_heads == 2
    test_greedy_equals_hf_generate(gqa)
    reqs = requests(gqa, PROMPTS, temperature=1.0, max_new_tokens=24, ignore_eos=True,
                    sampling_seed=5)
    for req, res in zip(reqs, gqa.generate(reqs), strict=True):
        expected = full_forward_logprobs(gqa, req, res, 1.0)
        assert (expected - torch.tensor(res.output_logprobs)).abs().max().item() < 1e-5


def test_greedy_is_deterministic_and_batch_independent(gen: EmbeddedGenerator) -> None:
    batch = gen.generate(requests(gen, PROMPTS, temperature=0.0, max_new_tokens=10))
    again = gen.generate(requests(gen, PROMPTS, temperature=0.0, max_new_tokens=10))
    assert [r.output_ids for r in batch] == [r.output_ids for r in again]
    for i, prompt in enumerate(PROMPTS):
        alone = gen.generate(requests(gen, [prompt], temperature=0.0, max_new_tokens=10))[0]
        assert alone.output_ids == batch[i].output_ids
        assert alone.output_logprobs == pytest.approx(batch[i].output_logprobs, abs=1e-5)


def test_seeded_sampling_is_reproducible_and_batch_independent(gen: EmbeddedGenerator) -> None:
    def run(prompts: list[str], seed: int) -> list[list[int]]:
        reqs = requests(gen, prompts, max_new_tokens=16, ignore_eos=True, sampling_seed=seed)
        return [r.output_ids for r in gen.generate(reqs)]

    first = run(PROMPTS, seed=11)
    assert run(PROMPTS, seed=11) == first
    assert run(PROMPTS, seed=12) != first
    assert run([PROMPTS[1]], seed=11) == [first[1]]
    assert run(PROMPTS[::-1], seed=11) == first[::-1]


def test_shared_prompts_sample_like_their_solo_runs(gen: EmbeddedGenerator) -> None:
    """A GRPO group: repeated prompts are prefilled once and each request still samples
    and reports log-probs as if alone (its own seed, the full forward's numbers)."""
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[1], PROMPTS[1], PROMPTS[3]]
    reqs = [
        GenRequest(
            f"g{i}",
            gen.tokenize(p),
            SamplingParams(max_new_tokens=12, ignore_eos=True, sampling_seed=i),
        )
        for i, p in enumerate(prompts)
    ]
    group = gen.generate(reqs)
    assert len({tuple(r.output_ids) for r in group}) > 2  # seeds differ, so do samples
    for req, res in zip(reqs, group, strict=True):
        alone = gen.generate([req])[0]
        assert alone.output_ids == res.output_ids
        assert alone.output_logprobs == pytest.approx(res.output_logprobs, abs=1e-5)
        ref = full_forward_logprobs(gen, req, res, 1.0)
        assert torch.tensor(res.output_logprobs) == pytest.approx(ref, abs=1e-5)


def test_unseeded_sampling_varies(gen: EmbeddedGenerator) -> None:
    reqs = requests(gen, ["1+1="] * 8, max_new_tokens=8, ignore_eos=True)
    outs = {tuple(r.output_ids) for r in gen.generate(reqs)}
    assert len(outs) > 1


def test_sampling_follows_the_distribution(gen: EmbeddedGenerator) -> None:
    """The first token's empirical frequencies match softmax(logits) (seeds 0..n-1)."""
    prompt = gen.tokenize("1+1=")
    n = 4000
    reqs = [
        GenRequest(
            str(s), prompt, SamplingParams(max_new_tokens=1, ignore_eos=True, sampling_seed=s)
        )
        for s in range(n)
    ]
    counts = Counter(r.output_ids[0] for r in gen.generate(reqs))
    with torch.no_grad():
        probs = torch.softmax(gen.model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    freq = torch.zeros_like(probs)
    for tok, c in counts.items():
        freq[tok] = c / n
    assert (freq - probs).abs().sum().item() < 0.2


def test_max_new_tokens_gives_length(gen: EmbeddedGenerator) -> None:
    res = gen.generate(requests(gen, PROMPTS, max_new_tokens=5, ignore_eos=True))
    for r in res:
        assert r.finish_reason == {"type": "length", "length": 5}
        assert len(r.output_ids) == 5
    zero = gen.generate(requests(gen, ["1"], max_new_tokens=0))[0]
    assert zero.output_ids == [] and zero.finish_reason == {"type": "length", "length": 0}


def test_stop_token_ids_end_generation(gen: EmbeddedGenerator) -> None:
    full = gen.generate(requests(gen, PROMPTS, temperature=0.0, max_new_tokens=12, ignore_eos=True))
    target = full[0].output_ids[3]
    cut = full[0].output_ids.index(target)
    res = gen.generate(
        requests(gen, PROMPTS[:1], temperature=0.0, max_new_tokens=12, stop_token_ids=(target,))
    )[0]
    assert res.finish_reason == {"type": "stop", "matched": target}
    assert res.output_ids == full[0].output_ids[: cut + 1]
    assert res.text == gen.tokenizer.decode(full[0].output_ids[:cut])


def test_eos_ends_generation_unless_ignored(gen: EmbeddedGenerator) -> None:
    """Swap the lm_head rows of the greedy first token and eos: eos becomes the argmax."""
    first = gen.generate(requests(gen, PROMPTS[:1], temperature=0.0, max_new_tokens=1))[0]
    tok, eos = first.output_ids[0], gen.tokenizer.eos_token_id
    state = {k: v.clone() for k, v in gen.model.state_dict().items()}
    state["lm_head.weight"][[tok, eos]] = state["lm_head.weight"][[eos, tok]]
    gen.update_weights(state, version=1)
    stopped = gen.generate(requests(gen, PROMPTS[:1], temperature=0.0, max_new_tokens=8))[0]
    assert stopped.finish_reason == {"type": "stop", "matched": eos}
    assert stopped.output_ids == [eos] and stopped.text == ""
    ignored = gen.generate(
        requests(gen, PROMPTS[:1], temperature=0.0, max_new_tokens=8, ignore_eos=True)
    )[0]
    assert ignored.finish_reason["type"] == "length" and ignored.output_ids[0] == eos


def test_stop_strings_are_matched_and_trimmed(gen: EmbeddedGenerator) -> None:
    full = gen.generate(requests(gen, PROMPTS, temperature=0.0, max_new_tokens=16, ignore_eos=True))
    text = full[1].text
    stop = text[4:6]
    end = text.find(stop) + len(stop)
    kw = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True, "stop": (stop,)}
    res = gen.generate(requests(gen, PROMPTS, **kw))
    assert res[1].finish_reason == {"type": "stop", "matched": stop}
    assert res[1].text == text[: text.find(stop)]
    assert res[1].output_ids == full[1].output_ids[:end]
    for i in (0, 2, 3):
        if stop not in full[i].text:
            assert res[i].output_ids == full[i].output_ids
    kept = gen.generate(requests(gen, PROMPTS[1:2], no_stop_trim=True, **kw))[0]
    assert kept.text == text[:end]


def test_abort_returns_partial_output(gen: EmbeddedGenerator) -> None:
    calls: Counter[str] = Counter()

    def should_abort(rid: str) -> bool:
        calls[rid] += 1
        return rid == "r1" and calls[rid] >= 3

    reqs = requests(gen, PROMPTS[:3], max_new_tokens=10, ignore_eos=True, sampling_seed=0)
    res = gen.generate(reqs, should_abort)
    assert res[1].finish_reason["type"] == "abort"
    assert len(res[1].output_ids) == len(res[1].output_logprobs) == 3
    assert res[0].finish_reason["type"] == res[2].finish_reason["type"] == "length"
    assert len(res[0].output_ids) == 10
    unaborted = gen.generate(reqs)
    assert unaborted[1].output_ids[:3] == res[1].output_ids
    for i in (0, 2):
        assert unaborted[i].output_ids == res[i].output_ids
        assert unaborted[i].output_logprobs == pytest.approx(res[i].output_logprobs, abs=1e-5)


def test_update_weights_changes_outputs_and_version(gen: EmbeddedGenerator) -> None:
    reqs = requests(gen, PROMPTS, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    before = gen.generate(reqs)
    assert gen.weight_version == 0 and before[0].weight_version == 0
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in gen.model.state_dict().items()}
    gen.update_weights(state, version=3)
    after = gen.generate(reqs)
    assert gen.weight_version == 3 and gen.model_info()["weight_version"] == 3
    assert all(r.weight_version == 3 for r in after)
    assert [r.output_logprobs for r in after] != [r.output_logprobs for r in before]
    with pytest.raises(ValueError, match="missing"):
        gen.update_weights({"lm_head.weight": torch.zeros_like(state["lm_head.weight"])}, 4)
    assert gen.weight_version == 3
    assert torch.equal(gen.model.state_dict()["lm_head.weight"], state["lm_head.weight"])
    info = gen.model_info()
    assert info["is_generation"] is True and info["model_path"] == gen.model_path


def test_batch_larger_than_max_batch_size(model_dir: str, gen: EmbeddedGenerator) -> None:
    small = EmbeddedGenerator(model_dir, max_batch_size=3, device="cpu")
    reqs = requests(small, PROMPTS * 2, temperature=0.0, max_new_tokens=4, ignore_eos=True)
    res = small.generate(reqs)
    assert [r.rid for r in res] == [r.rid for r in reqs]
    assert res[0].output_ids == res[4].output_ids


def test_invalid_sampling_params_name_the_field() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)


def test_mock_generator_is_deterministic_and_honours_limits(model_dir: str) -> None:
    mock = MockGenerator(vocab_size=50, eos_token_id=2, tokenizer_path=model_dir)
    req = GenRequest("a", [5, 6, 7], SamplingParams(max_new_tokens=30, sampling_seed=1))
    first = mock.generate([req])[0]
    assert mock.generate([req])[0] == first
    assert first.output_logprobs == pytest.approx(
        [-torch.log(torch.tensor(50.0)).item()] * len(first.output_ids)
    )
    assert first.finish_reason["type"] in {"stop", "length"}
    if first.finish_reason["type"] == "stop":
        assert first.output_ids[-1] == 2
    ignore = GenRequest(
        "b", [5, 6, 7], SamplingParams(max_new_tokens=30, sampling_seed=1, ignore_eos=True)
    )
    v0 = mock.generate([ignore])[0]
    assert v0.finish_reason == {"type": "length", "length": 30}
    aborted = mock.generate([ignore], lambda rid: True)[0]
    assert aborted.finish_reason["type"] == "abort" and len(aborted.output_ids) == 1
    mock.update_weights({}, version=2)
    moved = mock.generate([ignore])[0]
    assert moved.weight_version == 2 and moved.output_ids != v0.output_ids
    with pytest.raises(FileNotFoundError):
        mock.update_weights_from_disk(str(Path(model_dir) / "missing"))


def test_mock_token_seconds_take_wall_time_not_cpu_and_change_no_token(model_dir: str) -> None:
    """A fault test's stand-in for decoding: 20 tokens at 50 ms are a second in flight at
    almost no CPU, the same tokens as an instant mock, and an abort still lands between
    tokens."""
    import time

    instant = MockGenerator(vocab_size=50, eos_token_id=2, tokenizer_path=model_dir)
    slow = MockGenerator(vocab_size=50, eos_token_id=2, tokenizer_path=model_dir,
                         token_seconds=0.05)
    req = GenRequest("a", [5, 6, 7], SamplingParams(max_new_tokens=20, sampling_seed=1,
                                                    ignore_eos=True))
    wall, cpu = time.monotonic(), time.process_time()
    result = slow.generate([req])[0]
    wall, cpu = time.monotonic() - wall, time.process_time() - cpu
    assert result == instant.generate([req])[0]
    assert wall >= 20 * 0.05 and cpu < 0.5 * wall
    asked: list[str] = []

    def abort_at_the_fourth_ask(rid: str) -> bool:  # asked before each token after the first
        asked.append(rid)
        return len(asked) == 4

    aborted = slow.generate([req], abort_at_the_fourth_ask)[0]
    assert aborted.finish_reason["type"] == "abort" and len(aborted.output_ids) == 4


def _drain(gen: EmbeddedGenerator, batch: object, done: dict[str, GenResult]) -> None:
    while len(batch):  # type: ignore[arg-type]
        done.update((r.rid, r) for r in gen.step(batch, []))  # type: ignore[arg-type]


def test_request_joining_a_running_batch_matches_its_solo_run(gen: EmbeddedGenerator) -> None:
    """Continuous batching: B is prefilled and merged while A decodes; both equal their solo
    outputs (same seed) and a full-sequence forward."""
    kw = {"max_new_tokens": 14, "ignore_eos": True, "sampling_seed": 5}
    a = requests(gen, [PROMPTS[3]], **kw)[0]
    b = GenRequest("late", gen.tokenize(PROMPTS[1]), SamplingParams(**kw))  # type: ignore[arg-type]
    solo = {r.rid: r for r in gen.generate([a]) + gen.generate([b])}
    batch = gen.new_batch()
    done: dict[str, GenResult] = {}
    for _ in range(5):
        done.update((r.rid, r) for r in gen.step(batch, [a] if not len(batch) else []))
    assert batch.num_running == 1 and len(batch.rows[0].out_ids) == 5
    done.update((r.rid, r) for r in gen.step(batch, [b]))
    assert batch.num_running == 2
    _drain(gen, batch, done)
    for req in (a, b):
        assert done[req.rid].output_ids == solo[req.rid].output_ids
        expected = full_forward_logprobs(gen, req, done[req.rid], 1.0)
        assert (expected - torch.tensor(done[req.rid].output_logprobs)).abs().max() < 1e-5


def test_retract_then_resume_continues_the_same_sample(gen: EmbeddedGenerator) -> None:
    reqs = requests(gen, PROMPTS, max_new_tokens=10, ignore_eos=True, sampling_seed=9)
    solo = gen.generate(reqs)
    batch = gen.new_batch()
    done: dict[str, GenResult] = {}
    gen.step(batch, reqs)
    gen.step(batch, [])
    gen.retract(batch)
    assert batch.num_running == 0 and len(batch) == 4 and batch.cache is None
    _drain(gen, batch, done)
    for req, ref in zip(reqs, solo, strict=True):
        assert done[req.rid].output_ids == ref.output_ids
        assert done[req.rid].output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-4)


def test_abort_in_a_running_batch_keeps_the_others(gen: EmbeddedGenerator) -> None:
    reqs = requests(gen, PROMPTS, max_new_tokens=8, ignore_eos=True, sampling_seed=2)
    solo = gen.generate(reqs)
    batch = gen.new_batch()
    gen.step(batch, reqs)
    gen.step(batch, [])
    aborted = gen.abort(batch, ["r2", "unknown"])
    assert [r.rid for r in aborted] == ["r2"] and aborted[0].finish_reason["type"] == "abort"
    assert aborted[0].output_ids == solo[2].output_ids[:2]
    done: dict[str, GenResult] = {}
    _drain(gen, batch, done)
    assert {k: v.output_ids for k, v in done.items()} == {
        r.rid: s.output_ids for r, s in zip(reqs, solo, strict=True) if r.rid != "r2"
    }


def test_release_and_resume_memory_keep_outputs_identical(gen: EmbeddedGenerator) -> None:
    reqs = requests(gen, PROMPTS, max_new_tokens=6, ignore_eos=True, sampling_seed=4)
    before, checksum = gen.generate(reqs), gen.weights_checksum()
    gen.release_memory(["weights", "kv_cache"])
    assert sum(p.numel() for p in gen.model.parameters()) == 0
    with pytest.raises(RuntimeError, match="released"):
        gen.generate(reqs)
    gen.resume_memory(["weights", "kv_cache"])
    assert gen.weights_checksum() == checksum
    assert [r.output_logprobs for r in gen.generate(reqs)] == [r.output_logprobs for r in before]


def test_an_engine_hands_its_weights_to_a_fresh_one(gen: EmbeddedGenerator, model_dir: str) -> None:
    """A replacement engine loads a survivor's exported weights: the two then hold the same
    bytes and sample the same tokens (a copy, not views into the survivor's model)."""
    torch.manual_seed(1)
    gen.load_weights([(n, t + 0.01 * torch.randn_like(t))
                      for n, t in gen.model.state_dict().items()], 3)
    exported = gen.export_weights()
    fresh = EmbeddedGenerator(model_dir, num_threads=1, device="cpu")
    assert fresh.weights_checksum() != gen.weights_checksum()
    fresh.update_weights(exported, 3)
    assert fresh.weights_checksum() == gen.weights_checksum() and fresh.weight_version == 3
    reqs = requests(gen, ["1+2=", "7*8="], max_new_tokens=12, sampling_seed=4)
    assert [r.output_ids for r in fresh.generate(reqs)] == [r.output_ids for r in gen.generate(reqs)]
    exported[next(iter(exported))].add_(1.0)
    assert fresh.weights_checksum() == gen.weights_checksum() != weights_checksum(exported.items())
