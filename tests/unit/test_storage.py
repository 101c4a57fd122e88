"""Sample <-> Arrow round trip, batch IO and atomic object-store writes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

from storage.arrow_schema import samples_to_table, table_to_samples
from storage.batch_io import (
    read_samples,
    read_table,
    read_token_arrays,
    write_samples,
    write_table,
)
from storage.integrity import CorruptFileError
from storage.object_store import ObjectStore
from storage.run_layout import RunLayout
from storage.sample import Sample, Status
from tests.support import REPO_ROOT


def make_samples() -> list[Sample]:
    return [
        Sample(
            index=0, group_index=0, prompt="Grüße 👋 2+2=", tokens=[1, 2, 3, 4], response="4",
            response_length=1, label="4", reward=1.0, loss_mask=[1],
            rollout_log_probs=[-0.5], status=Status.COMPLETED, weight_version=3,
            metadata={"a": [1, 2], "nested": {"x": "ü"}},
        ),
        Sample(
            index=1, group_index=0,
            prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
            tokens=[5, 6], response="", response_length=0, label=None,
            reward={"acc": 1.0, "format": 0.25}, loss_mask=[], rollout_log_probs=[],
            status=Status.ABORTED, weight_version=0, metadata={},
        ),
        Sample(
            index=2, group_index=1, prompt="x", tokens=[7, 8, 9], response="ab",
            response_length=2, reward=None, loss_mask=[1, 0], rollout_log_probs=[-1.25, 0.0],
            status=Status.TRUNCATED,
        ),
    ]


def test_arrow_round_trip_is_exact():
    samples = make_samples()
    back = table_to_samples(samples_to_table(samples))
    assert back == samples
    assert isinstance(back[1].prompt, list) and back[1].reward == {"acc": 1.0, "format": 0.25}


def test_arrow_columns_are_typed():
    table = samples_to_table(make_samples())
    assert table.schema.field("tokens").type == pa.list_(pa.int32())
    assert table.schema.field("rollout_log_probs").type == pa.list_(pa.float32())
    assert table.column("reward").to_pylist() == [1.0, None, None]


def test_mismatched_loss_mask_is_rejected():
    bad = make_samples()[0]
    bad.loss_mask = [1, 1]
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        samples_to_table([bad])


@pytest.mark.parametrize("compression", ["zstd", "lz4", None])
def test_batch_io_round_trip(tmp_path, compression):
    store = ObjectStore(str(tmp_path))
    samples = make_samples()
    uri = write_samples(store, samples, "steps", "b.arrow", compression=compression)
    assert os.path.exists(uri)
    assert read_samples(store, "steps", "b.arrow") == samples
    assert read_table(store, "steps", "b.arrow").num_rows == 3


def test_uncompressed_batch_reads_zero_copy(tmp_path):
    store = ObjectStore(str(tmp_path))
    write_samples(store, make_samples(), "b.arrow", compression=None)
    table = read_table(store, "b.arrow")
    tokens = table.column("tokens").chunk(0).values
    # Memory-mapped buffers are not owned by the Python heap.
    assert not tokens.buffers()[1].is_mutable


def test_a_sliced_or_multi_chunk_table_reads_back_its_own_rows():
    samples = make_samples()
    table = samples_to_table(samples)
    assert table_to_samples(table.slice(1, 2)) == samples[1:]
    assert table_to_samples(pa.concat_tables([table.slice(0, 1), table.slice(2)])) == [
        samples[0], samples[2]]
    assert table_to_samples(table.slice(0, 0)) == []


READ_SCRIPT = """
import sys
from storage.batch_io import read_samples, read_token_arrays
from storage.object_store import ObjectStore
store = ObjectStore(sys.argv[1])
assert len(read_samples(store, "b.arrow")) == int(sys.argv[2])
assert len(read_token_arrays(store, "b.arrow").response_lengths) == int(sys.argv[2])
print("pandas" in sys.modules)
"""


def test_reading_a_batch_imports_no_pandas(tmp_path):
    """A trainer only reads batches; pyarrow's `to_numpy` would import pandas for it
    (about 0.25 CPU-s a process, `storage.arrow_schema.numeric_values`)."""
    samples = make_samples()
    write_samples(ObjectStore(str(tmp_path)), samples, "b.arrow")
    out = subprocess.run([sys.executable, "-c", READ_SCRIPT, str(tmp_path), str(len(samples))],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("compression", ["zstd", None])
def test_token_arrays_match_the_samples(tmp_path, compression):
    store = ObjectStore(str(tmp_path))
    samples = make_samples()
    write_samples(store, samples, "b.arrow", compression=compression)
    arrays = read_token_arrays(store, "b.arrow")
    for name, offsets, flat in (("tokens", arrays.token_offsets, arrays.tokens),
                                ("loss_mask", arrays.loss_mask_offsets, arrays.loss_mask),
                                ("rollout_log_probs", arrays.log_prob_offsets,
                                 arrays.rollout_log_probs)):
        rows = [flat[a:b].tolist() for a, b in zip(offsets, offsets[1:], strict=False)]
        assert rows == [getattr(s, name) for s in samples], name
    assert arrays.response_lengths.tolist() == [s.response_length for s in samples]
    assert arrays.tokens.dtype == np.int32 and arrays.rollout_log_probs.dtype == np.float32
    if compression is None:  # views of the memory-mapped file, not copies
        assert not arrays.tokens.flags.owndata and not arrays.tokens.flags.writeable


def test_token_arrays_of_a_file_that_is_not_a_sample_batch(tmp_path):
    store = ObjectStore(str(tmp_path))
    write_table(store, pa.table({"x": [1, 2]}), "other.arrow")
    with pytest.raises(CorruptFileError, match="not a sample batch"):
        read_token_arrays(store, "other.arrow")


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    store = ObjectStore(str(tmp_path))
    store.write_json({"a": 1}, "x", "y.json")
    store.write_json({"a": 2}, "x", "y.json")
    assert store.read_json("x", "y.json") == {"a": 2}
    assert store.list("x") == ["y.json"]


def _staged(root) -> dict[str, bytes]:
    files = {"model.bin": os.urandom(3000), "shards/part-0.distcp": os.urandom(5000)}
    for name, data in files.items():
        os.makedirs(os.path.dirname(root / name), exist_ok=True)
        (root / name).write_bytes(data)
    return files


@pytest.mark.parametrize("move", [False, True])
def test_put_dir_stores_every_file_and_moves_only_when_asked(tmp_path, move):
    """`move=True` (a checkpoint's staging dir) takes the files over by rename on the same
    file system: the stored file is the staged one, written once."""
    staged, store = tmp_path / "staging", ObjectStore(str(tmp_path / "store"))
    files = _staged(staged)
    inodes = {name: os.stat(staged / name).st_ino for name in files}
    store.put_dir(str(staged), "checkpoints", "000001", move=move)
    for name, data in files.items():
        stored = store.path("checkpoints", "000001", name)
        assert store.read_bytes("checkpoints", "000001", name) == data
        assert (os.stat(stored).st_ino == inodes[name]) is move
        assert (staged / name).exists() is not move
    assert not [n for _, _, fs in os.walk(tmp_path / "store") for n in fs if ".tmp-" in n]


def test_a_failed_move_leaves_the_staged_file_in_place(tmp_path):
    staged, store = tmp_path / "staging", ObjectStore(str(tmp_path / "store"))
    files = _staged(staged)
    os.makedirs(store.path("ckpt", "model.bin", "in-the-way"))  # a directory where a file goes
    with pytest.raises(OSError):
        store.put_dir(str(staged), "ckpt", move=True)
    assert (staged / "model.bin").read_bytes() == files["model.bin"]
    assert not [n for _, _, fs in os.walk(tmp_path / "store") for n in fs if ".tmp-" in n]


def test_run_layout_commits_in_order(tmp_path):
    layout = RunLayout.open(str(tmp_path), "run")
    assert layout.next_rollout_id() == 0
    layout.mark_committed(0)
    layout.mark_committed(1)
    layout.save_task_record(2, "generate", {"uri": "u"})
    assert layout.committed_steps() == [0, 1]
    assert layout.next_rollout_id() == 2
    assert layout.task_record(2, "generate") == {"uri": "u"}
    assert layout.task_record(2, "train") is None


@pytest.mark.parametrize("prompt, reward", [
    ("12+34=", 1.0),
    ([{"role": "user", "content": "hi"}], {"acc": 1.0, "len": 0.5}),
])
def test_clone_copies_every_field_and_shares_nothing_mutable(prompt, reward) -> None:
    import dataclasses

    from storage.sample import RoutedExperts, Sample, Status

    s = Sample(index=7, group_index=2, prompt=prompt, tokens=[1, 2, 3, 4], response="ab",
               response_length=2, label="46", reward=reward, loss_mask=[1, 0],
               rollout_log_probs=[-0.5, -0.25], status=Status.COMPLETED, weight_version=3,
               metadata={"a": [1, {"b": 2}], "source_line": 4},
               routed_experts=RoutedExperts.of([1, 0, 2]),  # immutable: shared by the clone
               token_versions=[2, 3])
    defaults = Sample(index=0, group_index=0)
    # every field is set away from its default, so equality covers a field clone forgot
    assert all(getattr(s, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(s))
    c = s.clone()
    assert c == s
    for name in ("prompt", "tokens", "reward", "loss_mask", "rollout_log_probs", "metadata",
                 "token_versions"):
        value = getattr(c, name)
        assert isinstance(value, str | float) or value is not getattr(s, name), name
    c.metadata["a"][1]["b"] = 9
    assert s.metadata["a"][1]["b"] == 2


def test_an_s3_endpoint_comes_from_the_config_or_the_options_but_not_two():
    from storage.object_store import open_store

    by_config = open_store("s3://b/runs", "http://127.0.0.1:9")
    by_options = open_store("s3://b/runs", None, endpoint_url="http://127.0.0.1:9")
    assert by_config.fs.client_kwargs["endpoint_url"] == "http://127.0.0.1:9"
    assert by_options.fs.endpoint_url == "http://127.0.0.1:9"
    assert open_store("s3://b/runs", "http://127.0.0.1:9", endpoint_url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="name two endpoints"):
        open_store("s3://b/runs", "http://127.0.0.1:9", endpoint_url="http://127.0.0.1:8")


def test_routed_experts_round_trip_exactly_and_stay_null_for_dense_rows(tmp_path):
    from storage.sample import RoutedExperts

    samples = make_samples()
    # [tokens[:-1] x 2 layers x top-2]; -1 marks a layer without a router; 300 > uint8
    samples[0].routed_experts = RoutedExperts.of(np.array([[[0, 7], [-1, -1]], [[3, 1], [-1, -1]],
                                                            [[300, 2], [-1, -1]]]))
    samples[2].routed_experts = RoutedExperts.of(np.arange(8).reshape(2, 2, 2))
    store = ObjectStore(str(tmp_path))
    write_samples(store, samples, "rollout.arrow")
    table = read_table(store, "rollout.arrow")
    assert table.schema.field("routed_experts").type == pa.list_(pa.int16())
    assert table.column("routed_experts").null_count == 1  # the dense (unrecorded) row
    back = read_samples(store, "rollout.arrow")
    assert back == samples and back[1].routed_experts is None
    assert back[0].routed_experts is not None and back[0].routed_experts.ids.dtype == np.int16
    assert back[0].routed_experts.per_token(3, 2, 2, "s")[2, 0].tolist() == [300, 2]
    assert table_to_samples(table.slice(2, 1)) == samples[2:]  # offsets of a slice
    # a batch written before the column existed reads as none recorded
    assert table_to_samples(table.drop_columns(["routed_experts"]))[0].routed_experts is None
    with pytest.raises(ValueError, match=r"^sample 0: routed_experts has 12 ids, not 3 tokens x "
                                         r"4 layers x top-2 = 24"):
        samples[0].routed_experts.per_token(3, 4, 2, "sample 0")


def test_token_versions_round_trip_and_an_older_batch_reads_as_not_recorded(tmp_path):
    samples = make_samples()
    for s in samples:
        s.token_versions = [3] * s.response_length
    samples[0].token_versions[-1] = 4  # a weight update landed before its last token
    store = ObjectStore(str(tmp_path))
    write_samples(store, samples, "rollout.arrow")
    back = read_samples(store, "rollout.arrow")
    assert back == samples and back[0].token_versions[-1] == 4
    older = table_to_samples(read_table(store, "rollout.arrow").drop_columns(["token_versions"]))
    assert [s.token_versions for s in older] == [[]] * len(samples)
    # not recorded: every token counts as the oldest version the sample knows
    older[0].metadata["start_weight_version"], older[0].weight_version = 1, 4
    assert older[0].response_versions() == [1] * older[0].response_length
