"""What the Prefect UI is given, without Prefect: rounded numbers, per-run keys and tags, the
inlined curves, the held-out table, the failure summary, the retry log's one-line cause."""

from __future__ import annotations

import base64
import io
import re

import pytest
from PIL import Image

from flows.bookkeeping.failure_notice import failure_summary, where_it_stopped
from flows.bookkeeping.labels import run_tags
from flows.bookkeeping.reporting import (
    UI_PLOT_SCALE,
    curves_markdown,
    eval_history,
    metrics_table,
    plot_curves,
    small_png,
)
from flows.config.loader import apply_overrides, config_from_dict
from storage.run_layout import RunLayout
from tasks.artifacts import artifact_key, eval_rows, for_people, staleness_rows
from tasks.retries import failure_line


def test_for_people_rounds_floats_to_four_significant_digits():
    assert for_people(0.123456789) == 0.1235
    assert for_people(123456.789) == 123500.0
    assert for_people(-0.00012345678) == -0.0001235
    assert for_people(7) == 7 and for_people(True) is True and for_people("a") == "a"
    assert for_people(0.0) == 0.0 and for_people(float("inf")) == float("inf")


def test_tables_round_but_keep_their_columns():
    rows = [{"rollout_id": 3, "reward/mean": 0.333333333, "time/train": 1.23456789, "x": 1.0}]
    assert metrics_table(rows) == [{"rollout_id": 3, "reward/mean": 0.3333, "time/train": 1.235}]
    assert eval_rows(4, {"eval/test": 0.87654321, "eval/test/samples": 8, "note": "x"}) == [
        {"weight_version": 4, "metric": "eval/test", "value": 0.8765},
        {"weight_version": 4, "metric": "eval/test/samples", "value": 8}]
    history = eval_history({2: {"eval/test": 0.5}, 0: {"eval/test": 0.123456}})
    assert history == [{"weight_version": 0, "eval/test": 0.1235},
                       {"weight_version": 2, "eval/test": 0.5}]


def test_the_staleness_table_has_a_row_per_weight_version_newest_first():
    metrics = {"rollout/staleness_tokens_2": 5.0, "rollout/staleness_tokens_0": 40.0,
               "rollout/staleness_max": 2.0}
    assert staleness_rows(7, metrics) == [
        {"weight_version": 7, "versions_behind": 0, "trained_tokens": 40},
        {"weight_version": 5, "versions_behind": 2, "trained_tokens": 5}]
    assert staleness_rows(7, {}) == []


def test_artifact_keys_are_slugs_of_the_run_name():
    assert artifact_key("My_Run.v2", "step-metrics") == "my-run-v2-step-metrics"
    assert re.fullmatch(r"[a-z0-9-]+", artifact_key("GRPO/λ 0.5", "eval"))


def test_run_tags_name_run_algorithm_and_backends():
    raw = {"data": {"prompt_data": "x.jsonl"},
           "rollout": {"num_rollout": 1, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
           "engine": {"backend": "mock"}, "train": {"backend": "mock"},
           "storage": {"run_name": "r1"}}
    cfg = config_from_dict(apply_overrides(raw, ["algorithm.advantage_estimator=rloo"]))
    assert run_tags(cfg) == ["rollflow", "run:r1", "algo:rloo", "engine:mock", "train:mock"]


def test_curves_are_inlined_as_a_small_png():
    rows = [{"rollout_id": k, "reward/mean": k / 10, "train/loss": 1 - k / 10} for k in range(10)]
    full = plot_curves(rows, {0: {"eval/test": 0.1}, 5: {"eval/test": 0.4}})
    png = small_png(full, scale=UI_PLOT_SCALE)
    assert Image.open(io.BytesIO(png)).width == round(Image.open(io.BytesIO(full)).width * 2 / 3)
    text = curves_markdown(png, "/runs/r1/curves.png")
    data = re.search(r"!\[[^\]]*\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", text).group(1)
    image = Image.open(io.BytesIO(base64.b64decode(data)))
    assert image.format == "PNG" and image.width >= 600 and len(text) < 40_000
    assert "/runs/r1/curves.png" in text


def test_failure_summary_names_step_task_cause_and_resume(tmp_path):
    layout = RunLayout.open(str(tmp_path), "r1")
    layout.store.write_text("x", "steps/000000", "metrics.json")
    layout.mark_committed(0)
    layout.save_task_record(1, "sample_prompts", {"seconds": 0.1})
    layout.mark_failed(1, "RewardError('nan')")
    stopped = where_it_stopped(layout, num_rollout=3)
    assert (stopped.committed, stopped.step, stopped.stage) == (1, 1, "generate")
    text = failure_summary("r1", layout.uri, "RewardError: nan", stopped, 3)
    assert "Training `r1` failed" in text and "RewardError: nan" in text
    assert "step 1, task `generate` (1 of 3 steps committed)" in text and "To resume" in text
    done = failure_summary("r1", layout.uri, "OSError: disk", where_it_stopped(layout, 1), 1)
    assert "all 1 steps were committed" in done


@pytest.mark.parametrize("wrapped", [False, True])
def test_failure_line_is_the_cause_inside_rays_wrapper(wrapped):
    cause = ConnectionError("injected transient fault\nmore detail")
    exc: BaseException = cause
    if wrapped:
        from ray.exceptions import RayTaskError

        exc = RayTaskError("generate", "Traceback ...", cause)
    assert failure_line(exc) == "ConnectionError: injected transient fault"
