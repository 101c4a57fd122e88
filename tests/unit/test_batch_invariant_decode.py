"""engine.batch_invariant: a request's tokens and log-probs are bitwise the same alone, in a
batch with others, joining a running batch, and resumed from a partial output."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.gen_types import GenRequest, GenResult, SamplingParams
from examples.arithmetic.build_model import save_tiny_model

OTHERS = ["12*34=?", "a", "what is 7+8? answer:", "9-4=", "1+1=", "77+5=", "3*3=", "8+8="]


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedGenerator]:
    threads = torch.get_num_threads()
    model = save_tiny_model(str(tmp_path_factory.mktemp("inv") / "tiny"))
    engine = EmbeddedGenerator(model, num_threads=2, device="cpu", continuous_steps=4,
                               batch_invariant=True)
    if engine._invariant_decoder() is None:
        pytest.skip("the compiled decode step is unavailable here")
    yield engine
    torch.set_num_threads(threads)


def request(gen: EmbeddedGenerator, rid: str, prompt: str, n: int = 10) -> GenRequest:
    return GenRequest(rid, gen.tokenize(prompt),
                      SamplingParams(max_new_tokens=n, ignore_eos=True, sampling_seed=len(rid)))


def until_done(gen: EmbeddedGenerator, first: list[GenRequest], later: list[GenRequest],
               after: int) -> dict[str, GenResult]:
    """`first` admitted at once, `later` after `after` turns of decoding."""
    batch, done = gen.new_batch(), {}
    turn = 0
    while turn == 0 or len(batch) or later:
        admit = first if turn == 0 else (later if turn == after else [])
        if turn == after:
            later = []
        done.update({r.rid: r for r in gen.step(batch, admit)})
        turn += 1
    return done


def test_logprobs_do_not_depend_on_the_batch(gen: EmbeddedGenerator) -> None:
    a = request(gen, "alone", "1+2=")
    alone = gen.generate([a])[0]
    others = [request(gen, f"o{i}" * (i + 1), p, n=4 + 3 * i) for i, p in enumerate(OTHERS)]
    batched = {r.rid: r for r in gen.generate([*others[:3], a, *others[3:]])}["alone"]
    joined = until_done(gen, others, [a], after=2)["alone"]
    for got in (batched, joined):
        assert got.output_ids == alone.output_ids
        assert torch.equal(torch.tensor(got.output_logprobs), torch.tensor(alone.output_logprobs))


def test_long_caches_do_not_depend_on_the_batch(gen: EmbeddedGenerator) -> None:
    """Caches of 16 keys and more, whose attention scores go 16 keys at a time where
    AVX-512 is there: alone, and shifted by another row's longer prompt (left padding moves
    each key to another column, so to another block of 16 or to the single keys)."""
    long = request(gen, "long", "what is 17+25? the answer:", n=24)
    alone = gen.generate([long])[0]
    for pad in ("a much longer question: what is 17+25+3+9? answer:", "1+1="):
        other = request(gen, "other", pad, n=30)
        got = {r.rid: r for r in gen.generate([other, long])}["long"]
        assert got.output_ids == alone.output_ids
        assert torch.equal(torch.tensor(got.output_logprobs), torch.tensor(alone.output_logprobs))


def test_a_resumed_partial_output_continues_with_the_same_numbers(gen: EmbeddedGenerator) -> None:
    """Re-prefilling a partial output (a resumed partial rollout) gives its tokens the keys and
    values decoding gave them: the rest of the response is bitwise what it would have been."""
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    prompt = gen.tokenize("12+30=")
    whole = gen.generate([GenRequest("whole", prompt, greedy)])[0]
    head = whole.output_ids[:4]
    rest = gen.generate([GenRequest("rest", prompt + head, SamplingParams(
        max_new_tokens=6, temperature=0.0, ignore_eos=True))])[0]
    assert head + rest.output_ids == whole.output_ids
    assert torch.equal(torch.tensor(rest.output_logprobs), torch.tensor(whole.output_logprobs[4:]))
