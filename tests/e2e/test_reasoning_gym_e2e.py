"""Two GRPO steps on a reasoning-gym task by config alone: the prompts, the reward and the
held-out set are reasoning_gym:// URIs, the embedded engine generates and the torch trainer
trains; what was stored scores as the task's own scorer scores it."""

from __future__ import annotations

import reasoning_gym

from engines.data.reasoning_gym import parse_task_uri
from engines.rollout.rewards.reasoning_gym import score_entry
from storage.batch_io import read_samples
from storage.run_layout import RunLayout

TASK = ("reasoning_gym://basic_arithmetic?seed={}&size={}&min_terms=2&max_terms=2&min_digits=1"
        "&max_digits=1&operators=+&allow_parentheses=false")
TRAIN, HELDOUT = TASK.format(1000, 64), TASK.format(5000, 8)


def test_two_grpo_steps_from_a_reasoning_gym_config(prefect_api, make_config):
    from flows.train import train

    cfg = make_config(
        "rg", f"data.prompt_data={TRAIN}", "rollout.rm_type=reasoning_gym",
        "eval.before_train=true", f"eval.datasets=[{{name: heldout, path: '{HELDOUT}'}}]",
        backend="embedded",
    )
    result = train(cfg)
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    assert layout.committed_steps() == [0, 1]

    generator = reasoning_gym.create_dataset("basic_arithmetic", **parse_task_uri(TRAIN).params)
    for k in (0, 1):
        for s in read_samples(layout.store, f"steps/{k:06d}", "rollout.arrow"):
            stored = s.metadata["reasoning_gym"]
            entry = generator[s.metadata["source_line"] - 1]
            assert stored["uri"] == TRAIN and stored["entry"]["question"] == entry["question"]
            assert s.prompt == entry["question"] and s.label == entry["answer"]
            assert s.reward == score_entry(TRAIN, entry, s.response)
    assert set(result["evals"]) == {0, 2}
    assert result["evals"][2]["eval/heldout/samples"] == 8
    assert 0.0 <= result["evals"][2]["eval/heldout"] <= 1.0
