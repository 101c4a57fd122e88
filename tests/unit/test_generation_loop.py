"""The generation loop, filters and the router manager against mock engines over real HTTP."""

from __future__ import annotations

import asyncio

import pytest

from engines.data.data_source import RolloutDataSourceWithBuffer
from engines.inference.engine_actor import EngineActor
from engines.rollout.filters import (
    check_reward_nonzero_std,
    resolve_dynamic_filter,
    resolve_over_sampling_filter,
    sort_by_reward_std,
)
from engines.rollout.generation import GenerationLoop, build_generation_loop, reset_to_prompt
from engines.rollout.sglang_client import SGLangClient
from flows.config.run import EngineConfig, RolloutConfig
from storage.sample import Sample, Status


def group(rewards: list[float], gi: int = 0) -> list[Sample]:
    return [Sample(index=gi * 10 + i, group_index=gi, reward=r) for i, r in enumerate(rewards)]


def test_filter_hub_builtins():
    assert not check_reward_nonzero_std(None, group([1.0, 1.0, 1.0]))
    assert check_reward_nonzero_std(None, group([0.0, 1.0, 1.0]))
    groups = [group([1, 1], 0), group([0, 1], 1), group([0, 0, 1, 1], 2), group([0, 0, 0, 1], 3)]
    # std: 0, 0.5, 0.5, 0.433 -> stable order for ties
    assert [g[0].group_index for g in sort_by_reward_std(None, groups)] == [1, 2, 3, 0]


def test_filter_resolution_names_the_config_key():
    assert resolve_dynamic_filter("check_reward_nonzero_std") is check_reward_nonzero_std
    assert resolve_over_sampling_filter("engines.rollout.filters:sort_by_reward_std") is sort_by_reward_std
    with pytest.raises(ValueError, match="rollout.dynamic_sampling_filter_path"):
        resolve_dynamic_filter("no_such_filter")
    with pytest.raises(ValueError, match="rollout.over_sampling_filter_path"):
        resolve_over_sampling_filter("engines.rollout.filters:missing")


def test_reset_to_prompt_keeps_only_the_prompt():
    s = Sample(index=0, group_index=0, tokens=[5, 6, 7])
    s.append_response([8, 9], [-0.5, -0.5], "xy")
    s.status = Status.ABORTED
    reset_to_prompt(s)
    assert (s.tokens, s.response_length, s.loss_mask, s.status) == ([5, 6, 7], 0, [], Status.PENDING)


def prompts(n: int) -> list[Sample]:
    return [Sample(index=-1, group_index=-1, prompt=f"p{i}", tokens=[1, 2, 3 + i]) for i in range(n)]


async def _run_dynamic(urls: list[str], cfg: RolloutConfig, target: int, keep_even: bool):
    source = RolloutDataSourceWithBuffer(prompts(50), n_samples_per_prompt=cfg.n_samples_per_prompt)
    clients = [SGLangClient(u) for u in urls]
    try:
        loop = build_generation_loop(
            cfg, clients, target=target,
            dynamic_filter=(lambda _a, g: g[0].group_index % 2 == 0) if keep_even else None,
        )
        return await loop.run_dynamic(source)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


def test_dynamic_sampling_refills_to_the_target(mock_engines):
    cfg = RolloutConfig(num_rollout=1, rollout_batch_size=3, n_samples_per_prompt=2,
                        over_sampling_batch_size=2, max_response_len=8, ignore_eos=True)
    result = asyncio.run(_run_dynamic(mock_engines, cfg, 3, keep_even=True))
    assert [g[0].group_index for g in result.kept] == [0, 2, 4]
    assert result.counts["dropped"] >= 2 and result.counts["drawn"] >= 5
    assert all(s.response_length == 8 and s.status == Status.TRUNCATED
               for g in result.kept for s in g)
    # Whatever was drawn is kept, dropped, failed or returned whole -- nothing else.
    c = result.counts
    assert c["drawn"] == c["kept"] + c["dropped"] + c["failed"] + c["returned"]
    assert all(len(g) == 2 for g in result.returned)
    assert result.metrics()["rollout/truncated_ratio"] == 1.0


def test_buffered_samples_older_than_the_staleness_bound_are_regenerated():
    engine = EngineActor(EngineConfig(backend="mock"), 0)
    engine.update_weights_from_tensor({}, 2)
    cfg = RolloutConfig(num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2,
                        max_response_len=4, ignore_eos=True, partial_rollout=True)
    stale = Sample(index=0, group_index=0, tokens=[1, 2, 3])
    stale.append_response([7, 7, 7, 7], [-1.0] * 4, "")
    stale.status, stale.metadata["start_weight_version"] = Status.TRUNCATED, 0
    partial = Sample(index=1, group_index=0, tokens=[1, 2, 3])
    partial.append_response([8, 8], [-1.0] * 2, "")
    partial.status, partial.metadata["start_weight_version"] = Status.ABORTED, 1

    async def run() -> GenerationLoop:
        async with SGLangClient(engine.url()) as client:
            loop = build_generation_loop(cfg, [client], min_weight_version=1)
            await loop.generate_group([stale, partial])
        return loop

    try:
        loop = asyncio.run(run())
    finally:
        engine.shutdown()
    assert loop.tally.stale_regenerated == 1
    # The too-old sample starts over on the current policy...
    assert stale.tokens[3:] != [7, 7, 7, 7] and stale.response_length == 4
    assert stale.metadata["start_weight_version"] == 2 and stale.weight_version == 2
    # ...the one within the bound keeps its tokens and continues.
    assert partial.tokens[3:5] == [8, 8] and partial.response_length == 4
    assert partial.metadata["start_weight_version"] == 1 and partial.weight_version == 2


def test_a_stale_buffered_group_is_dropped_whole_when_asked():
    """`rollout.stale_groups: drop`: the buffered group begun on a too-old policy is neither
    generated nor trained nor buffered again; the step draws a fresh prompt in its place."""
    engine = EngineActor(EngineConfig(backend="mock"), 0)
    engine.update_weights_from_tensor({}, 2)
    cfg = RolloutConfig(num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2,
                        max_response_len=4, ignore_eos=True, partial_rollout=True,
                        stale_groups="drop")
    source = RolloutDataSourceWithBuffer(prompts(5), n_samples_per_prompt=2)
    old = [Sample(index=900 + i, group_index=90, tokens=[1, 2, 3]) for i in range(2)]
    old[0].append_response([7, 7], [-1.0] * 2, "")
    old[0].status, old[0].metadata["start_weight_version"] = Status.ABORTED, 0
    source.add_samples([old])

    async def run():
        async with SGLangClient(engine.url()) as client:
            loop = build_generation_loop(cfg, [client], target=1, min_weight_version=1)
            return await loop.run_dynamic(source)

    try:
        result = asyncio.run(run())
    finally:
        engine.shutdown()
    assert result.counts["stale_dropped"] == 1 and result.counts["dropped"] == 1
    assert result.counts["stale_regenerated_samples"] == 0
    assert [g[0].group_index for g in result.kept] != [90] and len(result.kept) == 1
    assert all(s.weight_version == 2 for g in result.kept for s in g)
    assert old[0].tokens[3:] == [7, 7]  # not generated again
    assert all(g[0].group_index != 90 for g in result.returned + source.buffer)
