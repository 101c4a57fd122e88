"""bench.vs_trl's reading of two accuracy curves: the level each side reaches, and when."""

from __future__ import annotations

import pytest

from bench.vs_trl import Curve, Point, report, settled_accuracy, time_to


def curve(name: str, points: list[tuple[float, float]]) -> Curve:
    """(seconds, accuracy) per snapshot after a start at 50%; CPU is twice the wall time."""
    pts = [Point(0, 0.0, 0.0, 0.5)]
    pts += [Point(1000 * (i + 1), s, 2 * s, a) for i, (s, a) in enumerate(points)]
    return Curve(name, pts, startup=5.0, seconds=points[-1][0], cpu=2 * points[-1][0])


def test_settled_accuracy_is_the_mean_of_the_last_snapshots_not_the_start() -> None:
    trl = curve("TRL", [(10, 0.80), (20, 0.862), (30, 0.870), (40, 0.878)])
    assert settled_accuracy(trl) == pytest.approx(0.870)
    assert settled_accuracy(trl, last=1) == pytest.approx(0.878)
    assert settled_accuracy(curve("short", [(10, 0.6)])) == pytest.approx(0.6)


def test_a_run_that_settles_but_misses_the_last_snapshot_gets_a_settled_ratio_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trl = curve("TRL", [(10, 0.80), (20, 0.862), (30, 0.870), (40, 0.878)])
    ours = curve("rollflow", [(5, 0.85), (12, 0.872), (25, 0.874)])
    assert time_to(ours, 0.878) is None
    result = report([trl, ours], trl, ours)
    assert result["ratio"] is None and result["final_trl_accuracy"] == 0.878
    assert result["settled_trl_accuracy"] == pytest.approx(0.870)
    assert result["settled_ratio"] == pytest.approx(12 / 30)  # 87.2% at 12 s; TRL 87.0% at 30 s
    assert result["settled_cpu_ratio"] == pytest.approx(12 / 30)
    out = capsys.readouterr().out
    assert "final 87.8%: not reached" in out and "settled 87.0%" in out and "0.40x wall" in out


def test_a_run_that_reaches_the_final_level_gets_both_ratios() -> None:
    trl = curve("TRL", [(10, 0.80), (20, 0.862), (30, 0.870), (40, 0.878)])
    ours = curve("rollflow", [(5, 0.85), (10, 0.88)])
    result = report([trl, ours], trl, ours)
    assert result["ratio"] == pytest.approx(10 / 40)
    assert result["ratio_with_startup"] == pytest.approx(15 / 45)
    assert result["settled_ratio"] == pytest.approx(10 / 30)


def test_the_cpu_meter_follows_the_runs_actors(tmp_path) -> None:
    """Actor names gained the run directory's hash (`run~abc123:role@...`); the meter kept
    looking for `ray::run:` and counted none of the actors' CPU (0.11x "CPU ratio")."""
    from bench.vs_trl import actor_title_prefix
    from engines.cluster.registry import actor_name
    from flows.config.loader import config_from_dict

    def config(root: str) -> object:
        return config_from_dict({
            "data": {"prompt_data": "/d/train.jsonl"}, "train": {"model_path": "/m"},
            "rollout": {"num_rollout": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
            "storage": {"uri": root, "run_name": "vs"},
        })

    cfg = config(str(tmp_path))
    for role in ("trainer", "engine-0", "rollout"):
        assert f"ray::{actor_name(cfg, role)}".startswith(actor_title_prefix(cfg))
    other = actor_name(config(str(tmp_path / "x")), "trainer")  # same name, another root
    assert not f"ray::{other}".startswith(actor_title_prefix(cfg))
