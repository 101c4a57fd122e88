"""Several tokens per scheduler turn (`num_continuous_decode_steps`) in one compiled call:
the same tokens, log-probs and finishes as one token per turn, and every finish seen at the
token where it happens."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engines.config.engine import EngineConfig
from engines.inference.decode_batch import DecodeBatch
from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.engine_actor import GENERATOR_BACKENDS
from engines.inference.gen_types import GenRequest, GenResult, SamplingParams
from engines.inference.kv_cache import KVCache

PROMPTS = ["1+2=", "12*34=?", "a", "what is 7+8? answer:", "9-4=", "77+", "x", "3*3*3="]


@pytest.fixture()
def gen(tiny_model_dir: str) -> Iterator[EmbeddedGenerator]:
    threads = torch.get_num_threads()
    yield EmbeddedGenerator(tiny_model_dir, num_threads=2, device="cpu")
    torch.set_num_threads(threads)


def mixed_requests(gen: EmbeddedGenerator, stop_token: int | None = None) -> list[GenRequest]:
    """Greedy and sampled rows at several temperatures, budgets from 5 to 33 tokens, 16
    rows (two pool threads), each row stopping at `stop_token` if given."""
    out = []
    for i in range(16):
        params = SamplingParams(
            max_new_tokens=5 + 2 * i, temperature=(0.0, 1.0, 0.6, 1.3)[i % 4],
            ignore_eos=True, sampling_seed=i,
            stop_token_ids=() if stop_token is None else (stop_token,),
        )  # fmt: skip
        out.append(GenRequest(f"r{i}", gen.tokenize(PROMPTS[i % len(PROMPTS)]), params))
    return out


def outputs(results: list[GenResult]) -> list[tuple[list[int], dict]]:
    return [(r.output_ids, r.finish_reason) for r in results]


def turns(gen: EmbeddedGenerator, reqs: list[GenRequest]) -> list[list[int]]:
    """Step a batch to the end; each turn's token count per request (after the prefill)."""
    batch = gen.new_batch()
    gen.step(batch, reqs)
    counts: list[list[int]] = []
    while len(batch):
        before = {s.request.rid: len(s.out_ids) for s in _live(batch)}
        ended = gen.step(batch, [])
        grown = {r.rid: len(r.output_ids) for r in ended}
        grown |= {s.request.rid: len(s.out_ids) for s in _live(batch)}
        counts.append([grown[rid] - n for rid, n in before.items()])
    return counts


def _live(batch: DecodeBatch) -> list:
    return [batch.rows[j] for j in batch.live_rows()]


@pytest.mark.parametrize("steps", [4, 8, 32])
def test_several_steps_a_turn_give_what_one_step_a_turn_gives(
    gen: EmbeddedGenerator, steps: int
) -> None:
    """Same tokens, finishes (length and stop token, at different tokens per row) and
    log-probs (1e-6) as one token a turn."""
    plain = gen.generate(mixed_requests(gen))
    stop = plain[1].output_ids[3]  # a token some rows draw along the way
    reqs = mixed_requests(gen, stop_token=stop)
    one = gen.generate(reqs)
    assert {r.finish_reason["type"] for r in one} == {"length", "stop"}
    gen.continuous_steps = steps
    several = gen.generate(reqs)
    assert outputs(several) == outputs(one)
    for a, b in zip(several, one, strict=True):
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-6)


def test_a_turn_ends_at_the_token_where_a_row_finishes(gen: EmbeddedGenerator) -> None:
    """Budgets 5, 7, ..., 35 with 8 steps a turn: every live row gets the same number of
    tokens in a turn, at most 8, and a turn is cut short exactly where a row's budget ends
    (the caller sees each finish at its token, as with one step a turn)."""
    gen.continuous_steps = 8
    counts = turns(gen, mixed_requests(gen))
    assert all(len(set(turn)) == 1 and 1 <= turn[0] <= 8 for turn in counts)
    per_turn = [turn[0] for turn in counts]
    ends = sorted({5 + 2 * i - 1 for i in range(16)})  # tokens decoded after the prefill's one
    boundaries = [sum(per_turn[: i + 1]) for i in range(len(per_turn))]
    assert set(ends) <= set(boundaries)
    alone = GenRequest("alone", gen.tokenize(PROMPTS[0]),
                       SamplingParams(max_new_tokens=20, ignore_eos=True, sampling_seed=1))
    assert turns(gen, [alone]) == [[8], [8], [3]]  # 19 tokens after the prefill's one


def test_stop_strings_and_top_p_take_one_token_a_turn(gen: EmbeddedGenerator) -> None:
    """Stop strings are matched on the text and top-p sorts the distribution, both in
    Python after each token: such batches keep one token a turn, with the same outputs."""
    gen.continuous_steps = 8
    for params in ({"stop": ("zz",)}, {"top_p": 0.9}):
        reqs = [GenRequest(f"r{i}", gen.tokenize(p), SamplingParams(
            max_new_tokens=6, ignore_eos=True, sampling_seed=i, **params))  # type: ignore[arg-type]
            for i, p in enumerate(PROMPTS)]  # fmt: skip
        assert all(turn == [1] * len(PROMPTS) for turn in turns(gen, reqs)[:-1])


def test_a_request_joining_between_turns_samples_like_its_solo_run(gen: EmbeddedGenerator) -> None:
    gen.continuous_steps = 8
    kw = SamplingParams(max_new_tokens=20, ignore_eos=True, sampling_seed=5)
    a = GenRequest("a", gen.tokenize(PROMPTS[3]), kw)
    b = GenRequest("late", gen.tokenize(PROMPTS[1]), kw)
    solo = {r.rid: r for r in gen.generate([a]) + gen.generate([b])}
    batch = gen.new_batch()
    done = {r.rid: r for r in gen.step(batch, [a]) + gen.step(batch, [])}
    assert len(batch.rows[0].out_ids) == 9  # the prefill's token, then a turn of 8
    done.update((r.rid, r) for r in gen.step(batch, [b]))
    while len(batch):
        done.update((r.rid, r) for r in gen.step(batch, []))
    for req in (a, b):
        assert done[req.rid].output_ids == solo[req.rid].output_ids
        assert done[req.rid].output_logprobs == pytest.approx(solo[req.rid].output_logprobs,
                                                              abs=1e-5)


def test_the_engine_config_sets_the_steps_a_turn(tiny_model_dir: str) -> None:
    config = EngineConfig(backend="embedded", model_path=tiny_model_dir, num_continuous_decode_steps=3)
    generator = GENERATOR_BACKENDS["embedded"](config, 0, 1)
    assert isinstance(generator, EmbeddedGenerator) and generator.continuous_steps == 3


def test_a_turn_reserves_no_more_cache_than_its_rows_can_use(
    gen: EmbeddedGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is sized at prefill for the longest budget left; a turn of 8 asked for 8
    columns even where a row had 2 tokens left (the turn ends there), and grew the cache,
    copying every row, near each batch's end."""
    grew: list[int] = []
    reserve = KVCache.reserve

    def watched(cache: KVCache, columns: int) -> None:
        if cache.width + columns > cache.capacity:
            grew.append(columns)
        reserve(cache, columns)

    monkeypatch.setattr(KVCache, "reserve", watched)
    gen.continuous_steps = 8
    results = gen.generate(mixed_requests(gen))
    assert [len(r.output_ids) for r in results] == [5 + 2 * i for i in range(16)]
    assert grew == []
