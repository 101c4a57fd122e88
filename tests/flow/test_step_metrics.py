"""metrics.json of a mock run, built from the stage records' `to_metrics()`: the keys every
step has always had, the task records stored as the flat dicts they always were, and a step
re-run from its stored records commits the same metrics."""

from __future__ import annotations

import json

from engines.records import FilterRecord, GenerateRecord, RewardRecord, SamplePromptsRecord
from storage.run_layout import RunLayout
from tasks.records import TrainRecord

ROLLOUT_KEYS = {
    "rollout/abort_seconds", "rollout/aborted", "rollout/generated_tokens", "rollout/groups",
    "rollout/groups_aborted", "rollout/groups_drawn", "rollout/groups_dropped",
    "rollout/groups_failed", "rollout/groups_kept", "rollout/groups_resumed_samples",
    "rollout/groups_returned", "rollout/groups_stale_regenerated_samples",
    "rollout/groups_surplus", "rollout/response_len_max", "rollout/response_len_mean",
    "rollout/response_len_min", "rollout/response_len_std", "rollout/reward_timeouts",
    "rollout/samples", "rollout/seconds", "rollout/tokens_per_s", "rollout/truncated_ratio",
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


def test_metrics_json_keeps_its_keys_and_a_rerun_step_its_values(prefect_api, make_config):
    from engines.cluster.actors import kill_run_actors
    from flows.train import train

    cfg = make_config("metrics", "cluster.keep_actors=true")
    try:
        train(cfg)
        layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
        first, last = layout.step_metrics(0), layout.step_metrics(1)
        assert set(first) == EXPECTED_KEYS
        assert set(last) == EXPECTED_KEYS | {"checkpoint"}  # the last step checkpoints
        per_step = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
        assert (first["sample_prompts/groups"], first["generate/groups"], first["filter/kept"],
                first["reward/samples"], first["train/weight_version"],
                first["broadcast_weights/weight_version"]) == (4, 4, 4, per_step, 1.0, 1)
        assert first["train/seconds"] == first["time/train"]
        for k in (0, 1):
            for stage, kind in RECORDS.items():
                stored = layout.task_record(k, stage)
                assert stored is not None and kind.from_json(stored).to_json() == stored

        # Step 1 again from its stored records (as after a crash just before COMMITTED).
        layout.store.delete("steps/000001", "COMMITTED")
        layout.store.delete("steps/000001", "metrics.json")
        assert train(cfg)["resumed_at"] == 1
        again = layout.step_metrics(1)
        rerun_only = {"time/commit", "time/broadcast_weights", "broadcast_weights/seconds",
                      "broadcast_weights/engines_updated"}  # the push always runs again

        def same(m: dict) -> str:
            return json.dumps({k: v for k, v in m.items() if k not in rerun_only}, sort_keys=True)

        assert same(again) == same(last)
        assert again["broadcast_weights/engines_updated"] == 0  # the engines were up to date
    finally:
        kill_run_actors(cfg)
