"""Replay trains a run's saved batches again, with no engines, and reproduces its losses:
exactly with the mock trainer, within float tolerance with the torch trainer on the tiny
model (same initial weights, same seeds)."""

from __future__ import annotations

import json
import math
import uuid

import pytest
import ray

from engines.cluster.registry import get_run_actor
from flows.cli import main
from flows.config.run import ConfigError
from flows.replay import parse_steps, plan_replay, replay, replay_config
from storage.run_layout import RunLayout
from tests.support.configs import arithmetic_config


def test_parse_steps():
    assert parse_steps("2:5") == (2, 5) and parse_steps("3") == (3, 4)
    for bad in ("5:2", "a:b", "1:2:3", "-1:2"):
        with pytest.raises(ConfigError, match="--steps"):
            parse_steps(bad)


@pytest.fixture
def run_source(prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path):
    root = str(tmp_path / "runs")

    def run(overrides: list[str]):
        from flows.train import train

        cfg = arithmetic_config(
            run_name=f"src-{uuid.uuid4().hex[:6]}", runs_root=root, data=arithmetic_data,
            model_dir=tiny_model_dir, ray_address=ray_address, overrides=overrides,
        )
        train(cfg)
        return cfg, RunLayout.open(root, cfg.storage.run_name)

    return run


def losses(layout: RunLayout, steps: list[int], key: str = "train/loss") -> list[float]:
    return [layout.step_metrics(k)[key] for k in steps]


def test_mock_replay_reproduces_losses_and_starts_from_checkpoints(run_source, capsys):
    cfg, source = run_source(["rollout.num_rollout=3"])
    assert source.latest_checkpoint() == 2  # only the last step is checkpointed
    source_text = source.store.read_text("config.yaml")

    full = replay_config(source_text, cfg.storage.uri, cfg.storage.run_name, (0, 3), [])
    result = replay(full, cfg.storage.run_name, 0, 3)
    out = RunLayout.open(cfg.storage.uri, full.storage.run_name)
    assert full.storage.run_name == f"{cfg.storage.run_name}-replay-0-3"
    assert out.committed_steps() == [0, 1, 2]
    assert result["losses"] == losses(source, [0, 1, 2]) == losses(out, [0, 1, 2])
    assert losses(out, [0, 1, 2], "train/index_checksum") == losses(
        source, [0, 1, 2], "train/index_checksum")
    assert out.store.read_json("replay.json")["source_run"] == cfg.storage.run_name
    with pytest.raises(ValueError):  # no engines, and the trainer is released
        get_run_actor(cfg.cluster.namespace, full.storage.run_name, "trainer")

    # Steps 1..2 without a checkpoint before step 1: step 0 is trained first, unreported.
    capsys.readouterr()  # what the in-process replay above printed (Ray's raylet warnings)
    assert main(["replay", cfg.storage.run_name, "--steps", "1:3", "--root", cfg.storage.uri,
                 "--set", "cluster.keep_actors=true"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["plan"]["checkpoint"] is None and printed["plan"]["warmup"] == [0]
    assert printed["restored"]["replayed"] == [0]
    tail = RunLayout.open(cfg.storage.uri, f"{cfg.storage.run_name}-replay-1-3")
    # step 0 replays under the settings it trained under in the source run; the replayed
    # steps name theirs, for a rebuild of this run
    assert printed["restored"]["unrecorded"] == []
    assert tail.train_settings_of(0) == source.train_settings_of(0) is not None
    assert tail.train_settings_of(1) is not None
    assert tail.committed_steps() == [1, 2]
    assert losses(tail, [1, 2]) == losses(source, [1, 2])
    trainer = get_run_actor(cfg.cluster.namespace, f"{cfg.storage.run_name}-replay-1-3", "trainer")
    per_step = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    assert ray.get(trainer.trained_indices.remote()) == list(range(3 * per_step))
    ray.kill(trainer)


def test_replay_plan_uses_newest_complete_checkpoint(run_source):
    cfg, source = run_source(["rollout.num_rollout=3", "train.save_interval=1"])
    plan = plan_replay(source, cfg.storage.run_name, 2, 3)
    assert (plan.checkpoint, plan.warmup) == (1, [])
    with pytest.raises(ConfigError, match=r"steps \[3\] are not committed"):
        plan_replay(source, cfg.storage.run_name, 2, 4)


@pytest.mark.e2e
def test_torch_replay_reproduces_losses(run_source):
    # The mock engine's random tokens all score 0 under exact_match, so GRPO's advantages
    # would be 0; the SFT loss on those tokens gives real, changing losses and gradients.
    cfg, source = run_source(
        ["train.backend=torch", "rollout.num_rollout=2", "algorithm.loss_type=sft_loss"])
    replayed = replay_config(
        source.store.read_text("config.yaml"), cfg.storage.uri, cfg.storage.run_name, (0, 2), [])
    replay(replayed, cfg.storage.run_name, 0, 2)
    out = RunLayout.open(cfg.storage.uri, replayed.storage.run_name)
    a = losses(source, [0, 1])
    assert all(math.isfinite(x) and x > 0 for x in a) and a[0] != a[1], a
    timing = {"train/train_tokens_per_s", "train/seconds", "train/cpu_seconds"}
    for k in (0, 1):
        src = {key: v for key, v in source.step_metrics(k).items()
               if key.startswith("train/") and key not in timing}
        new = {key: out.step_metrics(k)[key] for key in src}
        assert src["train/grad_norm"] > 0
        assert new == pytest.approx(src, rel=1e-5, abs=1e-7, nan_ok=True), k
