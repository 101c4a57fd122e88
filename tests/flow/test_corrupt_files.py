"""The corrupted-file case through real flows: step 0's batch truncated and
checkpoints/LATEST deleted. The run still resumes (from the newest complete checkpoint, which
does not need step 0), and a replay of step 0 fails naming the file before copying anything."""

from __future__ import annotations

import uuid

import pytest

from flows.replay import replay, replay_config
from storage.integrity import CorruptFileError
from storage.run_layout import RunLayout, step_dir
from tests.support.configs import arithmetic_config


def test_truncated_batch_and_missing_latest(
    prefect_api, ray_address, arithmetic_data, tiny_model_dir, tmp_path, fault_matrix
):
    from flows.train import train

    cfg = arithmetic_config(
        run_name=f"corrupt-{uuid.uuid4().hex[:6]}", runs_root=str(tmp_path / "runs"),
        data=arithmetic_data, model_dir=tiny_model_dir, ray_address=ray_address,
        overrides=["rollout.num_rollout=2", "train.save_interval=1"],
    )
    train(cfg)  # the run's actors are released at the end: a rerun rebuilds the trainer
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    data = layout.store.read_bytes(step_dir(0), "train.arrow")
    layout.store.write_bytes(data[: len(data) // 2], step_dir(0), "train.arrow")
    layout.store.delete("checkpoints", "LATEST")

    longer = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"num_rollout": 3})})
    result = train(longer)
    assert result["resumed_at"] == 2
    assert result["restored"] == {"rebuilt": True, "version": 2, "replayed": [],
                                  "unrecorded": [], "inexact": []}
    assert layout.committed_steps() == [0, 1, 2]

    source_text = layout.store.read_text("config.yaml")
    again = replay_config(source_text, cfg.storage.uri, cfg.storage.run_name, (0, 2), [])
    with pytest.raises(CorruptFileError, match=r"steps/000000/train.arrow: \d+ bytes"):
        replay(again, cfg.storage.run_name, 0, 2)
    assert not RunLayout.open(cfg.storage.uri, again.storage.run_name).store.exists()
    fault_matrix.add("checkpoints/LATEST deleted", "resume", "newest complete checkpoint "
                     "found by scanning; run resumes", None)
    fault_matrix.add("committed train.arrow truncated", "read (replay / rebuild)",
                     "CorruptFileError naming the file; replay copies nothing", None)
