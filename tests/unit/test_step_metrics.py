"""metrics.json of a mock step, from the real rollout manager, trainer and engine run in this
process (no Ray, no Prefect) through the step tasks: the keys every step has always had,
and the task records stored as the flat dicts they always were. A step re-run from its
stored records by the train flow: tests/flow/test_step_metrics.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from engines.cluster.actors import RunActors
from engines.inference.engine_actor import EngineActor
from engines.records import FilterRecord, GenerateRecord, RewardRecord, SamplePromptsRecord
from engines.rollout.rollout_manager import RolloutManager
from engines.train.train_actor import TrainActor
from storage.run_layout import RunLayout
from tasks import step_tasks as t
from tasks.records import TrainRecord
from tasks.step_context import StepContext
from tests.support.fakes import IN_PROCESS, FakeProgressArtifact, InProcess

ROLLOUT_KEYS = {
    "rollout/abort_seconds", "rollout/aborted", "rollout/engines", "rollout/generated_tokens",
    "rollout/groups",
    "rollout/groups_aborted", "rollout/groups_drawn", "rollout/groups_dropped",
    "rollout/groups_failed", "rollout/groups_kept", "rollout/groups_resumed_samples",
    "rollout/groups_returned", "rollout/groups_stale_dropped",
    "rollout/groups_stale_regenerated_samples",
    "rollout/groups_restored", "rollout/groups_surplus", "rollout/journal_bytes",
    "rollout/judge_failures", "rollout/judge_retries", "rollout/judge_unparsed",
    "rollout/journal_encode_seconds", "rollout/journal_entries", "rollout/journal_write_seconds",
    "rollout/response_len_max", "rollout/response_len_mean",
    "rollout/response_len_min", "rollout/response_len_std", "rollout/reward_timeouts",
    "rollout/samples", "rollout/seconds", "rollout/staleness_max", "rollout/staleness_mean",
    "rollout/staleness_tokens_0", "rollout/token_version_max", "rollout/token_version_min",
    "rollout/tokens_per_s", "rollout/tokens_regenerated",
    "rollout/tokens_restored", "rollout/truncated_ratio",
}
TRAIN_KEYS = {f"train/{k}" for k in (
    "adv_mean", "approx_kl", "clipfrac", "cpu_seconds", "entropy", "grad_norm", "index_checksum",
    "kl_loss", "loss", "num_optimizer_steps", "num_samples", "pg_loss", "response_len_mean",
    "reward_mean", "reward_std", "rollout_logprob_abs_diff", "seconds", "skipped",
    "skipped_steps", "train_tokens_per_s", "weight_version",
)}
STAGES = ("sample_prompts", "generate", "filter", "reward", "train", "broadcast_weights")
# The keys of metrics.json of a mock step.
EXPECTED_KEYS = {
    "rollout_id", "time/commit",
    *(f"time/{s}" for s in STAGES), *(f"{s}/seconds" for s in STAGES),
    "sample_prompts/epoch", "sample_prompts/groups",
    "generate/buffer_groups", "generate/extra_draws", "generate/groups",
    "filter/failed", "filter/kept", "filter/over_sampling_dropped",
    "reward/mean", "reward/samples", "reward/std",
    "broadcast_weights/engines_updated", "broadcast_weights/weight_version",
    *ROLLOUT_KEYS, *TRAIN_KEYS,
}
RECORDS = {"sample_prompts": SamplePromptsRecord, "generate": GenerateRecord,
           "filter": FilterRecord, "reward": RewardRecord, "train": TrainRecord}


@pytest.fixture
def step_ctx(make_config: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[StepContext]:
    monkeypatch.setattr(t, "ProgressArtifact", FakeProgressArtifact)  # no Prefect API here
    cfg = make_config("metrics")
    engine = EngineActor(cfg.engine, 0, num_threads=1)
    rollout = RolloutManager(cfg)
    rollout.set_engines([engine.url()])
    actors = RunActors(rollout=InProcess(rollout), trainer=InProcess(TrainActor(cfg)),
                       engines=[InProcess(engine)], urls=[engine.url()])
    try:
        yield StepContext(cfg, RunLayout.open(cfg.storage.uri, cfg.storage.run_name), actors,
                          replies=IN_PROCESS)
    finally:
        engine.shutdown()


def run_step(ctx: StepContext, k: int) -> dict[str, Any]:
    sampled = t.sample_prompts.fn(ctx, k)
    generated = t.generate.fn(ctx, k)
    filtered = t.filter_groups.fn(ctx, k)
    rewarded = t.reward.fn(ctx, k, filtered.kept_groups)
    trained = t.train_step.fn(ctx, k)
    pushed = t.broadcast_weights.fn(ctx, k)
    return dict(t.commit.fn(ctx, k, [sampled, generated, filtered, rewarded, trained, pushed]))


def test_metrics_json_keeps_its_keys_and_records_their_stored_form(step_ctx):
    ctx = step_ctx
    first, last = run_step(ctx, 0), run_step(ctx, 1)
    assert set(first) == EXPECTED_KEYS
    assert set(last) == EXPECTED_KEYS | {"checkpoint"}  # the last step checkpoints
    stored = json.dumps(ctx.layout.step_metrics(1), sort_keys=True)
    assert stored == json.dumps(last, sort_keys=True)  # (as text: NaN != NaN)
    per_step = ctx.cfg.rollout.rollout_batch_size * ctx.cfg.rollout.n_samples_per_prompt
    assert (first["sample_prompts/groups"], first["generate/groups"], first["filter/kept"],
            first["reward/samples"], first["train/weight_version"],
            first["broadcast_weights/weight_version"]) == (4, 4, 4, per_step, 1.0, 1)
    assert first["train/seconds"] == first["time/train"]
    for k in (0, 1):
        for stage, kind in RECORDS.items():
            stored = ctx.layout.task_record(k, stage)
            assert stored is not None and kind.from_json(stored).to_json() == stored
