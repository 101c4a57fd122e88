"""Abort and partial rollout through the real sglang-router in front of two embedded engines.

Step 0 starts with one group that an earlier step left partial (390 of 400 tokens): it
finishes first, the step has its one group, and abort_all cuts the two fresh groups short
(each needs forty times the seeded group's ten tokens, so none can finish while the step
drains, however loaded the machine).
They go back to the buffer whole, with their partial tokens. Step 1 is run by a *new*
RolloutManager (a restart), which must find them in the saved data-source state and continue
them token for token.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from engines.inference.engine_actor import EngineActor
from engines.records import GenerateRecord
from engines.rollout.rollout_manager import RolloutManager
from flows.config.run import RollflowConfig
from storage.batch_io import read_samples, write_samples
from storage.run_layout import step_dir
from storage.sample import Group, Status, regroup
from tests.support.configs import arithmetic_config

MAX_LEN, SEEDED = 400, 390


@dataclass
class Step0:
    cfg: RollflowConfig
    urls: list[str]
    seeded: Group
    kept: list[Group]
    buffer: list[Group]
    record: GenerateRecord
    workers: list[dict[str, Any]]


def seed_partial_group(mgr: RolloutManager, vocab: int) -> Group:
    """Rewrite step 0's first drawn group as if an earlier step had been aborted at SEEDED
    tokens."""
    samples = read_samples(mgr.layout.store, step_dir(0), "prompts.arrow")
    rng = random.Random(0)
    for s in samples:
        if s.group_index == samples[0].group_index:
            s.append_response([rng.randrange(3, vocab) for _ in range(SEEDED)], [-1.0] * SEEDED, "")
            s.status = Status.ABORTED
    write_samples(mgr.layout.store, samples, step_dir(0), "prompts.arrow")
    return [s.clone() for s in samples if s.group_index == samples[0].group_index]


@pytest.fixture(scope="module")
def slower_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The fresh groups must still be decoding when abort_all lands, ~25 ms after the
    seeded group's last token on an idle machine (its reward, then HTTP). On the suite's
    2x64 model the engine made a fresh sample's 100 tokens in ~60 ms, and 1 run in ~5
    finished one first; 4x256 is several times slower a token, and with 400 tokens to make
    a fresh group still finished during the drain under CI load once (at 100 tokens).
    Positions for the prompt and MAX_LEN tokens."""
    from examples.arithmetic.build_model import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("slower") / "model"), 4, 256,
                           max_positions=512)


@pytest.fixture(scope="module")
def step0(arithmetic_data, slower_model_dir, tmp_path_factory) -> Iterator[Step0]:
    cfg = arithmetic_config(
        run_name="partial", runs_root=str(tmp_path_factory.mktemp("runs")),
        data=arithmetic_data, model_dir=slower_model_dir, ray_address="unused",
        backend="embedded",
        overrides=[
            "rollout.n_samples_per_prompt=2", "rollout.rollout_batch_size=1",
            "rollout.over_sampling_batch_size=3", f"rollout.max_response_len={MAX_LEN}",
            "rollout.ignore_eos=true", "rollout.partial_rollout=true",
            "rollout.mask_offpolicy_in_partial_rollout=true", "rollout.router_policy=round_robin",
        ],
    )
    engines = [EngineActor(cfg.engine, i, num_threads=1) for i in range(2)]
    urls = [e.url() for e in engines]
    mgr = RolloutManager(cfg)
    try:
        mgr.set_engines(urls)
        assert mgr.router is not None
        mgr.sample_prompts(0)
        seeded = seed_partial_group(mgr, len(mgr.tokenizer))
        record = mgr.generate(0)
        workers = mgr.router.workers()
        kept = regroup(read_samples(mgr.layout.store, step_dir(0), "rollout.arrow"))
        state = mgr.layout.store.read_json("datasource", "000000.json")
        buffer = regroup(read_samples(mgr.layout.store, "datasource", state["buffer_file"]))
        mgr.shutdown()
        yield Step0(cfg, urls, seeded, kept, buffer, record, workers)
    finally:
        mgr.shutdown()
        for e in engines:
            e.shutdown()


def test_abort_returns_partial_groups_whole(step0):
    assert sorted(w["url"] for w in step0.workers) == sorted(step0.urls)
    assert all(w["is_healthy"] for w in step0.workers)
    # The seeded group finished first and is the step's only group: its old tokens survive,
    # masked out of the loss (an older policy made them), and the new ones continue them.
    (kept,) = step0.kept
    assert kept[0].group_index == step0.seeded[0].group_index
    for old, new in zip(step0.seeded, kept, strict=True):
        assert new.tokens[: len(old.tokens)] == old.tokens
        assert new.response_length == MAX_LEN and new.status == Status.TRUNCATED
        assert new.rollout_log_probs[:SEEDED] == [-1.0] * SEEDED
        assert new.loss_mask == [0] * SEEDED + [1] * (MAX_LEN - SEEDED)
    # The two fresh groups were cut short by abort_all and wait in the buffer, whole.
    metrics = step0.record.rollout_metrics
    assert metrics["rollout/groups_aborted"] == 2
    assert metrics["rollout/groups_surplus"] == 0
    assert metrics["rollout/groups_kept"] == 1
    assert [len(g) for g in step0.buffer] == [2, 2]
    assert {g[0].group_index for g in step0.buffer}.isdisjoint({kept[0].group_index})
    aborted = [g for g in step0.buffer if g[0].status == Status.ABORTED]
    assert len(aborted) == metrics["rollout/groups_aborted"]
    for s in (s for g in step0.buffer for s in g):
        assert s.status == (Status.ABORTED if 0 < s.response_length < MAX_LEN else Status.TRUNCATED)
        assert len(s.loss_mask) == len(s.rollout_log_probs) == s.response_length
    for s in (s for g in aborted for s in g):
        assert 0 < s.response_length < MAX_LEN


def test_partial_buffer_survives_a_new_rollout_manager(step0):
    engines_cfg = step0.cfg
    mgr = RolloutManager(engines_cfg)  # a restarted actor: nothing in memory
    try:
        mgr.set_engines(step0.urls)
        mgr.sample_prompts(1)
        drawn = regroup(read_samples(mgr.layout.store, step_dir(1), "prompts.arrow"))
        saved = {s.index: s for g in step0.buffer for s in g}
        resumed = [s for g in drawn for s in g if s.index in saved]
        assert len(resumed) == 4  # both partial groups come back first, tokens intact
        for s in resumed:
            assert s.tokens == saved[s.index].tokens
            assert s.rollout_log_probs == saved[s.index].rollout_log_probs
        mgr.generate(1)
        kept = regroup(read_samples(mgr.layout.store, step_dir(1), "rollout.arrow"))
        state = mgr.layout.store.read_json("datasource", "000001.json")
        buffer = regroup(read_samples(mgr.layout.store, "datasource", state["buffer_file"]))
    finally:
        mgr.shutdown()
    (group,) = kept
    # The step keeps whichever drawn group finishes first: usually a resumed one (it has fewer
    # tokens to go), but under load the fresh group can win; then both resumed groups are cut
    # short again and wait in the buffer. Either way every resumed sample continues its saved
    # tokens and log-probs, and the older policy's tokens stay out of the loss.
    after_step1 = [s for g in [group, *buffer] for s in g if s.index in saved]
    assert sorted(s.index for s in after_step1) == sorted(saved)
    for s in after_step1:
        old = saved[s.index]
        assert s.tokens[: len(old.tokens)] == old.tokens
        assert s.rollout_log_probs[: old.response_length] == old.rollout_log_probs
        if old.status == Status.ABORTED:  # (a group that finished while draining is whole)
            assert s.loss_mask[: old.response_length] == [0] * old.response_length
        assert s.response_length >= old.response_length
    assert all(s.response_length == MAX_LEN for s in group)
    if group[0].index in saved and saved[group[0].index].status == Status.ABORTED:
        for s in group:
            old_len = saved[s.index].response_length
            assert s.loss_mask == [0] * old_len + [1] * (MAX_LEN - old_len)
    # Every group drawn so far is in exactly one place, whole: trained at step 0 or 1, or
    # waiting in the buffer.
    places = [step0.kept[0][0].group_index, group[0].group_index] + [
        g[0].group_index for g in buffer
    ]
    assert sorted(places) == [0, 1, 2, 3]
    assert all(len(g) == 2 for g in buffer)
