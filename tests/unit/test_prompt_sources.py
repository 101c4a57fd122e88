"""Prompt sets from anywhere, read lazily: shard directories and globs, Hugging Face
`save_to_disk` datasets, rows converted only when drawn, the driver's all-row check (Arrow
compute and row by row give the same error), and exact resume when rows are dropped."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines.data.data_source import RolloutDataSourceWithBuffer
from engines.data.prompt_dataset import (
    DatasetError,
    DatasetSpec,
    check_prompt_dataset,
    load_prompt_samples,
    open_prompt_dataset,
)
from storage.run_layout import RunLayout
from tests.support.fakes import CharTokenizer
from tests.support.samples import write_jsonl


def rows(start: int, n: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "label": str(i + 1), "metadata": {"i": i}}
            for i in range(start, start + n)]


def epoch(source: RolloutDataSourceWithBuffer, n: int) -> list[str]:
    return [g[0].prompt for g in source.get_samples(n)]


def shard_dir(tmp_path):
    """Three shards written out of name order, two formats, and files that are not data."""
    d = tmp_path / "shards"
    (d / "sub").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows(10, 4)), d / "sub" / "part-002.parquet")
    write_jsonl(d / "part-000.jsonl", rows(0, 3))
    pq.write_table(pa.Table.from_pylist(rows(3, 7)), d / "part-001.parquet")
    (d / "_SUCCESS").write_text("")
    (d / "README.md").write_text("not data")
    return d


def test_a_shard_directory_is_read_in_sorted_path_order(tmp_path):
    d = shard_dir(tmp_path)
    loaded = load_prompt_samples(DatasetSpec(str(d)), CharTokenizer())
    assert [s.prompt for s in loaded.samples] == [f"{i}+1=" for i in range(14)]
    # each sample says which shard and line (row) it came from
    first, fourth = loaded.samples[0], loaded.samples[3]
    assert first.metadata["source_file"] == str(d / "part-000.jsonl")
    assert (first.metadata["source_line"], fourth.metadata["source_line"]) == (1, 1)
    assert fourth.metadata["source_file"] == str(d / "part-001.parquet")
    source = RolloutDataSourceWithBuffer(open_prompt_dataset(DatasetSpec(str(d)), None), 1)
    assert sorted(epoch(source, 14)) == sorted(f"{i}+1=" for i in range(14))


def test_a_glob_picks_its_shards(tmp_path):
    d = shard_dir(tmp_path)
    loaded = load_prompt_samples(DatasetSpec(str(d / "*" / "*.parquet")), None)
    assert [s.label for s in loaded.samples] == [str(i + 1) for i in range(10, 14)]
    with pytest.raises(DatasetError, match="the pattern matches no"):
        load_prompt_samples(DatasetSpec(str(d / "*.csv")), None)


def test_a_bad_row_in_a_shard_names_that_shard_and_line(tmp_path):
    d = shard_dir(tmp_path)
    write_jsonl(d / "part-003.jsonl", [*rows(20, 2), {"prompt": "  "}])
    with pytest.raises(DatasetError) as err:
        check_prompt_dataset(DatasetSpec(str(d)), CharTokenizer())
    assert (err.value.path, err.value.line, err.value.field) == (
        str(d / "part-003.jsonl"), 3, "prompt")


def test_an_empty_directory_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no .jsonl, .json, .parquet or .arrow file"):
        open_prompt_dataset(DatasetSpec(str(tmp_path / "empty")), None)


def test_a_saved_hugging_face_dataset_and_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_list(rows(0, 6))
    test = datasets.Dataset.from_list(rows(100, 2))
    train.save_to_disk(str(tmp_path / "one"), num_shards=2)  # two Arrow files, in order
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dict"))

    source = RolloutDataSourceWithBuffer(
        open_prompt_dataset(DatasetSpec(str(tmp_path / "one")), CharTokenizer()), 2, seed=1)
    groups = source.get_samples(6)
    assert sorted(g[0].prompt for g in groups) == sorted(f"{i}+1=" for i in range(6))
    assert groups[0][0].tokens == [ord(c) for c in groups[0][0].prompt]
    assert groups[0][0].metadata["i"] == int(groups[0][0].label) - 1

    by_default = load_prompt_samples(DatasetSpec(str(tmp_path / "dict")), None).samples
    assert [s.prompt for s in by_default] == [f"{i}+1=" for i in range(6)]  # data: train
    eval_default = DatasetSpec(str(tmp_path / "dict"), config_key="eval.datasets[0]")
    assert [s.prompt for s in load_prompt_samples(eval_default, None).samples] == [
        "100+1=", "101+1="]  # an eval set: test
    with pytest.raises(DatasetError) as err:
        open_prompt_dataset(DatasetSpec(str(tmp_path / "dict"), split="validation"), None)
    assert err.value.problem == ("no split 'validation'; splits: ['train', 'test'] "
                                 "(set data.split)")


def test_rows_become_samples_only_when_drawn(tmp_path):
    """A bad row far into the set does not stop the set from opening or good rows from
    being drawn; it fails when drawn, naming its line."""
    path = write_jsonl(tmp_path / "d.jsonl", [*rows(0, 5), "{broken"])
    dataset = open_prompt_dataset(DatasetSpec(path), CharTokenizer())
    assert len(dataset) == 6
    assert [s.prompt for s in dataset.take([4, 0]) if s] == ["4+1=", "0+1="]
    with pytest.raises(DatasetError) as err:
        dataset.take([5])
    assert (err.value.line, err.value.field) == (6, "(row)")
    source = RolloutDataSourceWithBuffer(dataset, 1, shuffle=False)
    assert epoch(source, 5) == [f"{i}+1=" for i in range(5)]
    with pytest.raises(DatasetError, match=r"d.jsonl, line 6: not valid JSON"):
        source.get_samples(1)


def test_blank_lines_are_not_rows_and_lines_keep_their_numbers(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('\n  \n{"prompt": "a"}\n\n{"prompt": "b"}\r\n \t\n{"prompt": "c"}')
    samples = load_prompt_samples(DatasetSpec(str(path)), None).samples
    assert [(s.prompt, s.metadata["source_line"]) for s in samples] == [
        ("a", 3), ("b", 5), ("c", 7)]


@pytest.mark.parametrize("bad", [
    {"prompt": "   "}, {"prompt": None}, {"label": "no prompt"},
], ids=["blank", "null", "missing"])
def test_column_and_row_checks_give_the_same_error(tmp_path, bad):
    """The Arrow-compute check of a parquet set names the same row, field and problem as
    the row-by-row check of the same rows as JSON Lines."""
    data = [*rows(0, 4), bad, *rows(5, 3)]
    parquet, jsonl = tmp_path / "d.parquet", tmp_path / "d.jsonl"
    pq.write_table(pa.Table.from_pylist(data), parquet)
    write_jsonl(jsonl, data)
    errors = []
    for path in (parquet, jsonl):
        with pytest.raises(DatasetError) as err:
            check_prompt_dataset(DatasetSpec(str(path)), CharTokenizer())
        errors.append((err.value.line, err.value.field, err.value.problem))
    if bad.get("label") == "no prompt":  # parquet has the column (null), JSON lacks the key
        assert errors[0] == (5, "prompt", "must be a string or messages")
        assert errors[1] == (5, "prompt", "missing (set data.input_key)")
    else:
        assert errors[0] == errors[1] and errors[0][:2] == (5, "prompt")


def test_the_all_row_check_collects_reward_types(tmp_path):
    data = rows(0, 6)
    data[2]["metadata"]["rm_type"] = "math"
    data[4]["metadata"]["rm_type"] = "f1"
    for name, write in (("d.parquet", lambda p: pq.write_table(pa.Table.from_pylist(data), p)),
                        ("d.jsonl", lambda p: write_jsonl(p, data))):
        path = tmp_path / name
        write(path)
        check = check_prompt_dataset(DatasetSpec(str(path)), CharTokenizer())
        assert check.fields.vectorised  # parquet columns; JSON Lines typed by Arrow's reader
        unit = "row" if name.endswith(".parquet") else "line"
        assert check.fields.rm_types == {"math": f"{path}, {unit} 3", "f1": f"{path}, {unit} 5"}
        assert check.fields.without_rm_type == f"{path}, {unit} 1"
        assert (check.rows, check.tokenized, check.dropped_too_long) == (6, 6, 0)


def test_only_the_first_token_rows_are_tokenized_before_step_0(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [*rows(0, 3), {"prompt": "x" * 50}, *rows(3, 3)])
    spec = DatasetSpec(path, max_prompt_len=10)
    every = check_prompt_dataset(spec, CharTokenizer())
    assert (every.tokenized, every.dropped_too_long, every.usable) == (7, 1, 6)
    first = check_prompt_dataset(spec, CharTokenizer(), token_rows=3)
    assert (first.rows, first.tokenized, first.dropped_too_long) == (7, 3, 0)


def test_resume_is_exact_when_rows_are_dropped_as_drawn(tmp_path):
    """Too-long prompts are skipped as they are drawn and counted in the saved state; a
    source restored from that state draws exactly what the uninterrupted one draws."""
    data = [{"prompt": ("x" * 40 if i % 3 == 0 else f"{i}+1="), "label": str(i)}
            for i in range(30)]
    path = write_jsonl(tmp_path / "d.jsonl", data)
    spec = DatasetSpec(path, max_prompt_len=10)

    def source() -> RolloutDataSourceWithBuffer:
        return RolloutDataSourceWithBuffer(open_prompt_dataset(spec, CharTokenizer()), 2, seed=9)

    layout = RunLayout.open(str(tmp_path / "runs"), "r")
    ds = source()
    first = [s.prompt for g in ds.get_samples(7, 0) for s in g]
    assert "x" * 40 not in first and len(first) == 14
    ds.save(layout, 0)
    restored = source()
    restored.load(layout, 0)
    assert restored.state == ds.state and ds.state.rows_dropped > 0
    for k in range(1, 5):  # across epoch ends (20 usable prompts per epoch)
        assert restored.get_samples(7, k) == ds.get_samples(7, k)
    assert ds.state.epoch_id >= 1
    assert ds.state.rows_dropped == restored.state.rows_dropped


def test_a_set_whose_every_row_is_dropped_fails_instead_of_spinning(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * 40}] * 3)
    ds = RolloutDataSourceWithBuffer(
        open_prompt_dataset(DatasetSpec(path, max_prompt_len=10), CharTokenizer()), 1)
    with pytest.raises(ValueError, match="every row of the prompt set is dropped"):
        ds.get_samples(1)


def test_only_the_columns_a_row_is_read_for_are_loaded(tmp_path):
    path = tmp_path / "wide.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "label": ["1", "2"],
                             "big": ["z" * 1000, "y" * 1000]}), path)
    dataset = open_prompt_dataset(DatasetSpec(str(path)), None)
    assert dataset.rows.shards[0].table.column_names == ["prompt", "label"]
    assert json.dumps(dataset.take([1])[0].metadata) == '{"source_line": 2}'


def test_json_that_arrow_cannot_type_is_checked_row_by_row(tmp_path):
    """A label that is a number in one row and text in another (fine), then a bad row: the
    column check gives way to the row check, which still names the row."""
    path = write_jsonl(tmp_path / "d.jsonl", [*rows(0, 3), {"prompt": "a", "label": 5},
                                              {"prompt": [{"role": "user"}]}])
    with pytest.raises(DatasetError) as err:
        check_prompt_dataset(DatasetSpec(path), None)
    assert (err.value.line, err.value.problem) == (5, "chat messages need 'role' and 'content'")
    ok = write_jsonl(tmp_path / "ok.jsonl", [*rows(0, 3), {"prompt": "a", "label": 5}])
    check = check_prompt_dataset(DatasetSpec(ok), None)
    assert check.rows == 4 and not check.fields.vectorised


def test_a_dataset_in_the_local_hub_cache(tmp_path, monkeypatch):
    """`hf://datasets/org/name` resolves in the hub cache without the network (here a cache
    laid out as `hf download` leaves it), picking the split by name."""
    pytest.importorskip("datasets")
    import datasets.config
    import huggingface_hub.constants

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "datasets--org--toy"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit / "data"
    snapshot.mkdir(parents=True)
    write_jsonl(snapshot / "train.jsonl", rows(0, 4))
    write_jsonl(snapshot / "test.jsonl", rows(50, 2))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))

    source = RolloutDataSourceWithBuffer(
        open_prompt_dataset(DatasetSpec("hf://datasets/org/toy"), None), 1, shuffle=False)
    assert epoch(source, 4) == [f"{i}+1=" for i in range(4)]
    held = DatasetSpec("hf://datasets/org/toy", config_key="eval.datasets[0]")
    assert [s.label for s in load_prompt_samples(held, None).samples] == ["51", "52"]
    with pytest.raises(DatasetError, match=r"not in the local hub cache \(download it first"):
        open_prompt_dataset(DatasetSpec("hf://datasets/org/absent"), None)
