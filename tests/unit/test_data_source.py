"""Data source: epochs, seeded shuffle, buffer priority, state round trip, bad rows."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines.data.data_source import RolloutDataSourceWithBuffer
from engines.data.prompt_dataset import DatasetError, DatasetSpec, load_prompt_samples
from storage.run_layout import RunLayout
from storage.sample import Sample, Status
from tests.support.fakes import CharTokenizer
from tests.support.samples import write_jsonl


def prompts(n: int) -> list[Sample]:
    return [Sample(index=-1, group_index=-1, prompt=f"p{i}", label=str(i)) for i in range(n)]


def drawn_prompts(groups) -> list[str]:
    return [g[0].prompt for g in groups]


def test_groups_are_deep_copies_with_unique_indices():
    ds = RolloutDataSourceWithBuffer(prompts(5), n_samples_per_prompt=3, seed=1)
    groups = ds.get_samples(2)
    assert [len(g) for g in groups] == [3, 3]
    assert [s.index for g in groups for s in g] == list(range(6))
    assert [g[0].group_index for g in groups] == [0, 1]
    groups[0][0].metadata["x"] = 1
    assert "x" not in groups[0][1].metadata


def test_epochs_cover_every_prompt_and_reshuffle():
    ds = RolloutDataSourceWithBuffer(prompts(6), n_samples_per_prompt=1, seed=3)
    first = drawn_prompts(ds.get_samples(4)) + drawn_prompts(ds.get_samples(2))
    assert sorted(first) == sorted(f"p{i}" for i in range(6))
    second = drawn_prompts(ds.get_samples(6))
    assert ds.state.epoch_id == 1
    assert sorted(second) == sorted(first) and second != first


def test_draw_straddling_an_epoch_boundary():
    ds = RolloutDataSourceWithBuffer(prompts(5), n_samples_per_prompt=1, seed=0)
    ds.get_samples(4)
    batch = ds.get_samples(3)
    assert len(batch) == 3 and ds.state.epoch_id == 1 and ds.state.sample_offset == 2


def test_shuffle_is_deterministic_per_seed():
    a = RolloutDataSourceWithBuffer(prompts(20), 1, seed=7)
    b = RolloutDataSourceWithBuffer(prompts(20), 1, seed=7)
    c = RolloutDataSourceWithBuffer(prompts(20), 1, seed=8)
    assert drawn_prompts(a.get_samples(20)) == drawn_prompts(b.get_samples(20))
    assert drawn_prompts(a.get_samples(20)) != drawn_prompts(c.get_samples(20))


def test_buffer_is_served_first():
    ds = RolloutDataSourceWithBuffer(prompts(10), n_samples_per_prompt=2, seed=0)
    first = ds.get_samples(3)
    ds.add_samples([first[1]])
    nxt = ds.get_samples(2)
    assert nxt[0] is first[1]
    assert nxt[1][0].group_index == 3
    assert ds.buffer == []


def test_add_samples_rejects_partial_groups():
    ds = RolloutDataSourceWithBuffer(prompts(4), n_samples_per_prompt=2, seed=0)
    g = ds.get_samples(1)[0]
    with pytest.raises(ValueError, match="expected n_samples_per_prompt=2"):
        ds.add_samples([g[:1]])


def test_custom_buffer_filter_is_used():
    def pop_last(args, rollout_id, buffer, n):
        taken = buffer[-n:]
        del buffer[-n:]
        return taken

    ds = RolloutDataSourceWithBuffer(prompts(10), 1, seed=0, buffer_filter=pop_last)
    g = ds.get_samples(3)
    ds.add_samples(g)
    assert ds.get_samples(1)[0] is g[2]


def test_a_buffer_filter_returning_no_groups_is_a_hook_error():
    """A wrong result is the same on every retry: a HookError naming the hook, not a
    TypeError from `len(None)` that the step task would retry."""
    from engines.hooks.loader import HookError

    def forgot_return(args, rollout_id, buffer, n):
        del buffer[:n]

    ds = RolloutDataSourceWithBuffer(prompts(10), 1, seed=0, buffer_filter=forgot_return)
    ds.add_samples(ds.get_samples(2))
    with pytest.raises(HookError, match=r"^rollout.buffer_filter_path: .*forgot_return returned "
                       r"NoneType None, expected a list of groups"):
        ds.get_samples(1)


def test_state_round_trip_with_non_empty_buffer(tmp_path):
    layout = RunLayout.open(str(tmp_path), "run")
    ds = RolloutDataSourceWithBuffer(prompts(7), n_samples_per_prompt=2, seed=5)
    groups = ds.get_samples(3, rollout_id=0)
    partial = groups[2]
    for s in partial:
        s.append_response([9, 9], [-0.5, -0.25], "zz")
        s.status = Status.ABORTED
        s.weight_version = 4
    ds.add_samples([partial])
    ds.save(layout, 0)

    restored = RolloutDataSourceWithBuffer(prompts(7), n_samples_per_prompt=2, seed=5)
    restored.load(layout, 0)
    assert restored.state == ds.state
    assert restored.buffer == ds.buffer
    assert restored.buffer[0][0].rollout_log_probs == [-0.5, -0.25]
    assert restored.get_samples(3) == ds.get_samples(3)


def test_dataset_keys_chat_template_and_length_filter(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"q": [{"role": "user", "content": "hi"}], "a": 3, "meta": {"k": 1}},
        {"q": "a much longer prompt than allowed", "a": "x"},
    ])
    spec = DatasetSpec(path, input_key="q", label_key="a", metadata_key="meta",
                       apply_chat_template=True, max_prompt_len=30)
    loaded = load_prompt_samples(spec, CharTokenizer())
    samples = loaded.samples
    assert len(samples) == 1 and loaded.dropped_too_long == 1
    assert samples[0].prompt == "user:hi|assistant:"
    assert samples[0].tokens == [ord(c) for c in "user:hi|assistant:"]
    assert samples[0].label == "3" and samples[0].metadata["k"] == 1


def test_parquet_dataset(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "label": ["2", "4"]}), path)
    samples = load_prompt_samples(DatasetSpec(path), CharTokenizer()).samples
    assert [s.label for s in samples] == ["2", "4"]


@pytest.mark.parametrize(
    ("rows", "line", "field"),
    [
        (['{"prompt": "ok"}', '{"prompt": 3}'], 2, "prompt"),
        (['{"prompt": "ok"}', "", '{"label": "x"}'], 3, "prompt"),
        (['{"prompt": "ok"}', "{not json"], 2, "(row)"),
        (['{"prompt": "ok", "metadata": [1]}'], 1, "metadata"),
    ],
)
def test_malformed_row_names_file_line_and_field(tmp_path, rows, line, field):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DatasetError) as err:
        load_prompt_samples(DatasetSpec(path), CharTokenizer())
    assert (err.value.path, err.value.line, err.value.field) == (path, line, field)
    assert "bad.jsonl" in str(err.value) and f"line {line}" in str(err.value)
