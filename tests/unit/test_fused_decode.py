"""The compiled decode step against the Python one it replaces: same logits, same cache."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from engines.inference import fused_decode
from engines.inference.kv_cache import KVCache
from engines.inference.kv_decode import LlamaDecoder
from engines.inference.sampling import SamplingRows, sample_tokens, seeded_uniform
from examples.arithmetic.build_model import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("fused") / "tiny"))


def load_model(model_dir: str, **overrides: object) -> torch.nn.Module:
    """The tiny model, or one of its layout with `overrides` and fresh random weights."""
    if not overrides:
        return AutoModelForCausalLM.from_pretrained(model_dir).eval()
    config = AutoConfig.from_pretrained(model_dir)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def prefilled(model: torch.nn.Module, room: int) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """18 left-padded prompts of different lengths, prefilled: cache, last logits, positions
    (enough rows for two threads: a block has at least 8)."""
    lengths = [3, 7, 1, 5, 7, 2] * 3
    width = max(lengths)
    torch.manual_seed(0)
    ids = torch.randint(3, 20, (len(lengths), width))
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    past_key_values=cache, use_cache=True)
    return KVCache.from_prefill(cache, mask, room), out.logits[:, -1], positions[:, -1]


def decode_both(
    model: torch.nn.Module, steps: int, room: int, mode: type = torch.inference_mode,
    row_invariant: bool = False,
) -> float:
    """Decode `steps` tokens with both steps on copies of one cache (the Python step's greedy
    tokens fed to both); returns the largest logit difference, after checking the caches."""
    python = LlamaDecoder(model, use_fused=False)
    compiled = LlamaDecoder(model, row_invariant=row_invariant)
    cache_a, logits, last = prefilled(model, room)
    cache_b, _, _ = prefilled(model, room)
    worst = 0.0
    with mode():
        for step in range(1, steps + 1):
            tokens = logits.argmax(-1)
            logits = python(tokens, last + step, cache_a)
            other = compiled(tokens, last + step, cache_b)
            worst = max(worst, (logits - other).abs().max().item())
    assert compiled._fused_weights is not None  # the compiled step ran
    assert cache_a.width == cache_b.width and torch.equal(cache_a.mask, cache_b.mask)
    for a, b in zip(cache_a.layers, cache_b.layers, strict=True):
        assert torch.allclose(a[..., : cache_a.width, :], b[..., : cache_b.width, :], atol=1e-5)
    return worst


def test_the_compiled_step_builds_on_this_machine() -> None:
    """Without it the engine still works, 1.5-2.5x slower: a CI machine that cannot build it
    should say so here, not in a benchmark."""
    assert fused_decode.load() is not None


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad])
def test_compiled_step_equals_the_python_step(model_dir: str, threads: int, mode: type) -> None:
    """Padded rows, a cache that grows past its first capacity (4 free columns, 20 steps),
    on one thread and on two (each a block of rows: a pool thread must run in the caller's
    inference or no-grad mode, or ATen refuses to update the caller's tensors)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert decode_both(load_model(model_dir), steps=20, room=4, mode=mode) < 1e-5
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("overrides", [{}, {"intermediate_size": 100, "vocab_size": 83}])
def test_the_row_invariant_step_equals_the_python_step(model_dir: str, overrides: dict) -> None:
    """engine.batch_invariant's chains (lanes along the outputs, a masked last register when
    an output count is not a multiple of 16: 2 x 100 gate|up, 83 logits) and its exp compute
    what MKL's matmuls and ATen's silu compute, to float rounding."""
    model = load_model(model_dir, **overrides)
    assert decode_both(model, steps=20, room=4, row_invariant=True) < 1e-5


def test_grouped_query_attention(model_dir: str) -> None:
    """Two kv heads for four query heads: each kv head serves its group (HF's repeat_kv)."""
    assert decode_both(load_model(model_dir, num_key_value_heads=2), steps=12, room=16) < 1e-5


@pytest.mark.parametrize("row_invariant", [False, True])
def test_new_weights_are_used_at_the_next_step(model_dir: str, row_invariant: bool) -> None:
    """A weight update copies into the parameters in place: the compiled step must not keep
    the weights it gathered before (q|k|v and gate|up are copies; every weight is, for the
    row-invariant chains)."""
    model = load_model(model_dir)
    compiled = LlamaDecoder(model, row_invariant=row_invariant)
    cache, logits, last = prefilled(model, 8)
    with torch.no_grad():
        compiled(logits.argmax(-1), last + 1, cache)
        for p in model.parameters():
            p.mul_(0.9)
        python = LlamaDecoder(model, use_fused=False)
        reference, _, _ = prefilled(model, 8)
        python(logits.argmax(-1), last + 1, reference)
        compiled_cache, _, _ = prefilled(model, 8)
        compiled(logits.argmax(-1), last + 1, compiled_cache)
        tokens = torch.arange(18) % 15 + 3
        expected = python(tokens, last + 2, reference)
        got = compiled(tokens, last + 2, compiled_cache)
    assert (expected - got).abs().max().item() < 1e-5


@pytest.mark.parametrize("overrides", [{"attention_bias": True}, {"dtype": "bfloat16"}])
def test_what_it_does_not_cover_runs_the_python_step(model_dir: str, overrides: dict) -> None:
    """Biases (the compiled step has none) and non-float32 weights keep the Python step."""
    model = load_model(model_dir, **{k: v for k, v in overrides.items() if k != "dtype"})
    if "dtype" in overrides:
        model = model.to(torch.bfloat16)
    decoder = LlamaDecoder(model)
    cache, logits, last = prefilled(model, 4)
    with torch.no_grad():
        out = decoder(logits.argmax(-1), last + 1, cache)
    assert decoder._fused_weights is None and out.shape == logits.shape


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch, model_dir: str) -> None:
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    assert fused_decode.load() is None
    assert LlamaDecoder(load_model(model_dir))._fused is None


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path: Path) -> None:
    """torch's builder waits for ever on a lock file its killed predecessor left."""
    (tmp_path / "lock").touch()
    fused_decode._clear_stale_lock(tmp_path)
    assert (tmp_path / "lock").exists()  # a build may be under way
    old = time.time() - fused_decode.STALE_LOCK_SECONDS - 5
    os.utime(tmp_path / "lock", (old, old))
    fused_decode._clear_stale_lock(tmp_path)
    assert not (tmp_path / "lock").exists()


def test_the_engine_gives_the_compiled_step_two_threads_from_16_rows(model_dir: str) -> None:
    """The compiled step wakes the thread pool once a step, so two threads pay from two
    blocks of 8 rows; the Python step's threshold (4,096 activations: 32 rows here) left
    batch 16 on one thread, ~40% slower."""
    from engines.inference.embedded_generator import EmbeddedGenerator
    from engines.inference.gen_types import GenRequest, SamplingParams

    before = torch.get_num_threads()
    gen = EmbeddedGenerator(model_dir, num_threads=2, device="cpu")
    try:
        seen: dict[int, int] = {}
        for rows in (8, 16):
            reqs = [GenRequest(f"r{i}", gen.tokenize("12+34="), SamplingParams(
                max_new_tokens=3, ignore_eos=True, sampling_seed=i)) for i in range(rows)]
            batch = gen.new_batch()
            gen.step(batch, reqs)  # prefill
            gen.step(batch, [])  # a decode step
            seen[rows] = torch.get_num_threads()
        assert gen._decoder.parallel_rows == 16  # type: ignore[union-attr]
        assert seen == {8: 1, 16: 2}
    finally:
        torch.set_num_threads(before)


def test_a_position_outside_the_rope_table_is_refused(model_dir: str) -> None:
    """The compiled step reads the table by position unchecked; it must raise, not read
    past the table's end."""
    model = load_model(model_dir)
    decoder = LlamaDecoder(model)
    cache, logits, last = prefilled(model, 4)
    with torch.inference_mode():
        decoder(logits.argmax(-1), last + 1, cache)  # gathers the weights
        table = decoder._rope_rows(cache.width).shape[0]
        with pytest.raises(RuntimeError, match="outside the RoPE table"):
            decoder(logits.argmax(-1), last + table, cache)


def test_each_python_environment_builds_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build records its torch's include paths: two venvs sharing a build directory
    rebuilt it in turn, ~50 s at each one's first load."""
    here = fused_decode.build_directory("x")
    assert fused_decode.build_directory("x") == here
    monkeypatch.setattr("sys.prefix", "/another/venv")
    assert fused_decode.build_directory("x") != here


def sampling_rows(temps: list[float], vocab: int, top_p: float = 1.0) -> SamplingRows:
    n = len(temps)
    return SamplingRows.of(torch.tensor(temps), torch.full((n,), top_p),
                           torch.full((n,), vocab), vocab)


def test_the_compiled_sampler_draws_what_the_python_one_draws() -> None:
    """Same tokens and log-probs within 1e-6 for temperatures 0 (greedy), 0.5, 1 and 1.7
    in one batch, a vocabulary of 50 with two tokens masked to -inf, 300 rows."""
    torch.manual_seed(1)
    rows, vocab = 300, 50
    logits = torch.randn(rows, vocab) * 3
    logits[:, [4, 9]] = float("-inf")
    temps = [(0.0, 0.5, 1.0, 1.7)[i % 4] for i in range(rows)]
    spec = sampling_rows(temps, vocab)
    uniform = seeded_uniform(torch.arange(rows), 7)
    tokens, logps = fused_decode.sample_tokens(fused_decode.load(), logits, spec, uniform)
    want_tokens, want_logps = sample_tokens(logits, spec, uniform)
    assert torch.equal(tokens, want_tokens)
    assert torch.allclose(logps, want_logps, atol=1e-6)
    assert not torch.isin(tokens, torch.tensor([4, 9])).any()
    assert len(set(tokens[1::4].tolist())) > 10  # it sampled rather than took the argmax
    assert torch.equal(tokens[::4], logits[::4].argmax(-1))


def test_the_compiled_sampler_greedy_and_truncated_batches() -> None:
    """All rows greedy (no uniforms): the argmax; a row with top-p < 1: the Python sampler,
    which truncates, runs instead."""
    torch.manual_seed(2)
    logits = torch.randn(20, 30)
    module = fused_decode.load()
    tokens, logps = fused_decode.sample_tokens(module, logits, sampling_rows([0.0] * 20, 30), None)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logps, torch.log_softmax(logits, -1).max(-1).values, atol=1e-6)
    truncated = sampling_rows([1.0] * 20, 30, top_p=0.3)
    uniform = seeded_uniform(torch.arange(20), 0)
    assert torch.equal(fused_decode.sample_tokens(module, logits, truncated, uniform)[0],
                       sample_tokens(logits, truncated, uniform)[0])
