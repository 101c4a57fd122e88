"""Context parallelism's layout and what it is refused with, without a process group: the
zigzag chunks cover a row once and balance causal attention, the gathered order puts every
position back, and a trainer without enough ranks or with a setting it cannot split says so
in one line."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engines.train.context_parallel import (
    ContextGroup,
    global_order,
    local_positions,
    padded_length,
    zigzag_chunks,
)
from flows.config.run import TrainConfig


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_ranks_hold_every_position_once_and_the_order_restores_it(size: int) -> None:
    length = padded_length(37, size)
    assert length % (2 * size) == 0 and 37 <= length < 37 + 2 * size
    held = torch.cat([local_positions(length, size, r) for r in range(size)])
    assert sorted(held.tolist()) == list(range(length))
    gathered = held * 10  # what rank r's tokens carry, in the order the all-gather returns
    assert gathered[global_order(length, size)].tolist() == [p * 10 for p in range(length)]


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_rank_gets_the_same_causal_attention_work(size: int) -> None:
    length = padded_length(1000, size)
    work = []
    for rank in range(size):  # keys a query at position p sees: p + 1
        positions = local_positions(length, size, rank)
        work.append(int((positions + 1).sum()))
        (a0, a1), (b0, b1) = zigzag_chunks(length, size, rank)
        assert a1 - a0 == b1 - b0 == length // (2 * size) and a1 <= b0
    assert len(set(work)) == 1, work


def test_one_rank_is_no_group_and_a_group_must_divide_the_ranks() -> None:
    assert ContextGroup.build(1) is None
    with pytest.raises(ValueError, match="context_parallel=2 needs a train group of a multiple"):
        ContextGroup.build(2)  # no process group: one rank


@pytest.mark.parametrize(("settings", "clash"), [
    ({"backend": "megatron"}, "train.backend=megatron"),
    ({"pack_sequences": True}, "train.pack_sequences"),
    ({"share_prompts": True}, "train.share_prompts"),
    ({"lora": {"rank": 8}, "model_path": "m"}, "train.lora"),
])
def test_settings_context_parallelism_cannot_split_are_refused(settings: dict, clash: str) -> None:
    with pytest.raises(ValidationError, match=f"context_parallel=2 .* not supported with {clash}"):
        TrainConfig.model_validate({"context_parallel": 2, **settings})
    TrainConfig.model_validate({"context_parallel": 1, **settings})


def test_a_run_whose_train_ranks_it_does_not_divide_or_with_a_critic_is_refused() -> None:
    from flows.config.loader import config_from_dict
    from flows.config.run import ConfigError

    def run(cluster: dict, algorithm: dict | None = None) -> object:
        return config_from_dict({
            "data": {"prompt_data": "x.jsonl"},
            "rollout": {"num_rollout": 1, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
            "engine": {"backend": "mock"}, "cluster": cluster, "algorithm": algorithm or {},
            "train": {"model_path": "m", "context_parallel": 2},
        })

    run({"actor_num_gpus_per_node": 4})
    with pytest.raises(ConfigError, match="context_parallel=2 does not divide the 3 train ranks"):
        run({"actor_num_gpus_per_node": 3})
    with pytest.raises(ConfigError, match="context_parallel=2 with a PPO critic"):
        run({"actor_num_gpus_per_node": 2}, {"advantage_estimator": "ppo"})
