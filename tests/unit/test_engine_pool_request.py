"""`rollflow engines add|remove|show RUN`: the request it stores in the run directory, and
which pool size a run then has (storage/engine_pool.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from flows.cli import main
from storage.engine_pool import PoolRequest, read_pool_request
from storage.object_store import open_store


def _run(root: Path, config: dict) -> None:
    (root / "r").mkdir(parents=True)
    (root / "r" / "config.yaml").write_text(yaml.safe_dump(config))


def _engines(root: Path, *args: str, capsys) -> tuple[int, str]:
    code = main(["engines", *args, "r", "--root", str(root)])
    return code, capsys.readouterr().out.strip()


def test_add_and_remove_store_the_pool_the_next_step_starts(tmp_path, capsys):
    _run(tmp_path, {"engine": {"num_engines": 1}})
    assert _engines(tmp_path, "add", capsys=capsys) == (
        0, "run r: engine pool 1 -> 2 at its next weight push (the end of the step it is in)")
    assert _engines(tmp_path, "add", "--count", "2", capsys=capsys)[0] == 0
    request = read_pool_request(open_store(str(tmp_path)).child("r"))
    assert request is not None and (request.num_engines, request.configured) == (4, 1)
    assert _engines(tmp_path, "remove", "--count", "3", capsys=capsys)[0] == 0
    assert _engines(tmp_path, "show", capsys=capsys) == (
        0, "run r: engine pool 1 (engine.num_engines=1)")
    code = main(["engines", "remove", "r", "--root", str(tmp_path)])
    assert code == 1 and "keeps at least one" in capsys.readouterr().err  # never below one


def test_an_edited_config_count_overrides_an_older_request(tmp_path, capsys):
    _run(tmp_path, {"engine": {"num_engines": 1}})
    _engines(tmp_path, "add", capsys=capsys)
    assert PoolRequest(2, 1).target(1) == 2
    assert PoolRequest(2, 1).target(3) == 3  # the config changed since: it is the newer word
    (tmp_path / "r" / "config.yaml").write_text(yaml.safe_dump({"engine": {"num_engines": 3}}))
    assert _engines(tmp_path, "show", capsys=capsys)[1].startswith("run r: engine pool 3")


def test_a_fixed_pool_or_a_missing_run_is_refused(tmp_path, capsys):
    _run(tmp_path, {"engine": {"backend": "sglang", "urls": ["http://a:1"]}})
    assert main(["engines", "add", "r", "--root", str(tmp_path)]) == 1
    assert "engine.urls lists its servers" in capsys.readouterr().err
    assert main(["engines", "add", "nope", "--root", str(tmp_path)]) == 1
    assert not (tmp_path / "r" / "engines.json").exists()


def test_the_engine_count_leaves_a_step_s_group_journal_valid():
    """A rerun with another `engine.num_engines` replays the journal of the step it resumes
    (a group's tokens do not depend on how many engines made them); other engine settings
    do not."""
    from engines.rollout.restore import settings_fingerprint
    from tests.support.configs import small_config

    one = settings_fingerprint(small_config())
    assert settings_fingerprint(small_config("engine.num_engines=3")) == one
    assert settings_fingerprint(small_config("engine.dtype=bfloat16")) != one
