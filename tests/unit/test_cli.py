"""`rollflow runs list|show` over a run directory, and config errors at the CLI."""

from __future__ import annotations

from flows.cli import main
from storage.run_layout import RunLayout


def make_run(root, name, steps):
    layout = RunLayout.open(str(root), name)
    layout.store.write_text("data: {}\n", "config.yaml")
    for k in range(steps):
        layout.store.write_json({"rollout_id": k, "reward/mean": 0.25 * k, "train/loss": 1.5},
                                f"steps/{k:06d}", "metrics.json")
        layout.mark_committed(k)
    layout.save_eval(steps, {"eval/test": 0.75})
    return layout


def test_runs_list_and_show(tmp_path, capsys):
    make_run(tmp_path, "alpha", 3)
    make_run(tmp_path, "beta", 1)
    (tmp_path / "not-a-run").mkdir()
    assert main(["runs", "list", "--root", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split("\t")[0] for ln in lines] == ["alpha", "beta"]
    assert "steps=3" in lines[0] and "eval/test=0.75" in lines[0]

    assert main(["runs", "show", "alpha", "--root", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].split("\t")[:3] == ["rollout_id", "reward/mean", "train/loss"]
    assert [row.split("\t")[1] for row in out[1:4]] == ["0", "0.25", "0.5"]
    assert out[4].startswith("eval@v3") and "eval/test=0.75" in out[4]


def test_runs_show_unknown_run(tmp_path, capsys):
    assert main(["runs", "show", "nope", "--root", str(tmp_path)]) == 1
    assert "no run 'nope'" in capsys.readouterr().err


def test_train_with_bad_override_names_the_key(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {prompt_data: x.jsonl}\nrollout: {num_rollout: 1, rollout_batch_size: 1}\n"
                   "engine: {backend: mock}\ntrain: {backend: mock}\n")
    assert main(["train", "--config", str(cfg), "--set", "rollout.temprature=0.5"]) == 2
    assert "rollout.temprature" in capsys.readouterr().err
