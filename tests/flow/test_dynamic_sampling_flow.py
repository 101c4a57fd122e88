"""Dynamic sampling under real Prefect + Ray with mock engines: dropped groups are refilled
and every step trains exactly rollout_batch_size whole groups, none twice; a sample filter
keeps samples in their groups but out of the loss."""

from __future__ import annotations

import uuid

import ray

from engines.cluster.registry import get_run_actor
from storage.batch_io import read_samples
from storage.run_layout import RunLayout
from storage.sample import regroup
from tests.support.configs import arithmetic_config


def test_dynamic_filter_drops_and_over_sampling_refills(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path
):
    from flows.train import train

    cfg = arithmetic_config(
        run_name=f"dyn-{uuid.uuid4().hex[:8]}", runs_root=str(tmp_path / "runs"),
        data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
        overrides=[
            "rollout.n_samples_per_prompt=2", "rollout.over_sampling_batch_size=6",
            "rollout.dynamic_sampling_filter_path=tests.support.hooks:drop_odd_groups",
            "rollout.over_sampling_filter_path=sort_by_reward_std",
            "rollout.sample_filter_path=tests.support.hooks:train_on_first_of_group",
            "cluster.keep_actors=true",
        ],
    )
    train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0, 1]
    trained_groups: list[int] = []
    for k in (0, 1):
        groups = regroup(read_samples(layout.store, f"steps/{k:06d}", "train.arrow"))
        assert len(groups) == cfg.rollout.rollout_batch_size == 4
        assert all(len(g) == 2 for g in groups)
        assert all(g[0].group_index % 2 == 0 for g in groups)
        for g in groups:  # the sample filter: each group's second sample out of the loss
            first, second = sorted(g, key=lambda s: s.index)
            assert any(first.loss_mask) and not any(second.loss_mask), (first, second)
        trained_groups += [g[0].group_index for g in groups]
        m = layout.step_metrics(k)
        # 6 even groups kept means at least 5 odd ones were generated and dropped.
        assert m["rollout/groups_kept"] == 6 and m["rollout/groups_dropped"] >= 5
        assert m["filter/over_sampling_dropped"] == 2
        assert m["reward/removed_samples"] == 4
        assert m["rollout/groups_drawn"] >= 11
    assert len(set(trained_groups)) == 8
    trainer = get_run_actor(cfg.cluster.namespace, cfg.storage.run_name, "trainer")
    indices = ray.get(trainer.trained_indices.remote())
    assert len(indices) == len(set(indices)) == 16
    # Groups that were still running at the abort wait in the buffer, whole.
    state = layout.store.read_json("datasource", "000001.json")
    buffer = regroup(read_samples(layout.store, "datasource", state["buffer_file"]))
    assert len(buffer) == state["buffer_groups"]
    assert all(len(g) == 2 for g in buffer)
    assert not set(trained_groups) & {g[0].group_index for g in buffer}
    from engines.cluster.actors import kill_run_actors
    kill_run_actors(cfg)
