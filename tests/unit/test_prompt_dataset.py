"""Dataset checks at load time: empty prompts, empty files, missing parquet columns, prompts
too long for the model (dropped and counted), and error messages that name the config key."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from engines.data.prompt_dataset import DatasetError, DatasetSpec, load_prompt_samples
from tests.support.fakes import CharTokenizer
from tests.support.samples import write_jsonl


def load_error(spec: DatasetSpec) -> DatasetError:
    with pytest.raises(DatasetError) as err:
        load_prompt_samples(spec, CharTokenizer())
    return err.value


@pytest.mark.parametrize(
    "prompt",
    ["", "   \n\t", [], [{"role": "system", "content": ""}, {"role": "user", "content": "  "}]],
    ids=["empty", "whitespace", "no-messages", "blank-messages"],
)
def test_empty_prompt_is_rejected_with_its_line(tmp_path, prompt):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ok"}, {"prompt": prompt}])
    err = load_error(DatasetSpec(path, apply_chat_template=True))
    assert (err.path, err.line, err.field, err.problem) == (path, 2, "prompt", "empty prompt")


def test_chat_messages_with_one_nonempty_content_load(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]}])
    loaded = load_prompt_samples(DatasetSpec(path, apply_chat_template=True), CharTokenizer())
    assert [s.prompt for s in loaded.samples] == ["system:|user:hi|assistant:"]


@pytest.mark.parametrize("content", ["", "\n\n"], ids=["empty", "blank-lines"])
def test_empty_jsonl_file_says_no_rows(tmp_path, content):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    err = load_error(DatasetSpec(str(path)))
    assert (err.line, err.field, err.problem) == (0, "(file)", "no rows")


def test_empty_parquet_file_says_no_rows(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    assert load_error(DatasetSpec(path)).problem == "no rows"


def test_parquet_without_the_input_column_lists_its_columns(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"question": ["1+1="], "answer": ["2"]}), path)
    err = load_error(DatasetSpec(path, input_key="prompt", config_key="eval.datasets[0]"))
    assert (err.line, err.field) == (0, "prompt")
    assert "columns: ['question', 'answer']" in err.problem
    assert "eval.datasets[0].input_key" in err.problem


def test_missing_or_unreadable_files_are_dataset_errors(tmp_path):
    err = load_error(DatasetSpec(str(tmp_path / "nope.jsonl")))
    assert (err.line, err.field) == (0, "(file)") and "No such file" in err.problem
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    assert "parquet" in load_error(DatasetSpec(str(bad))).problem
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    err = load_error(DatasetSpec(str(latin)))
    assert (err.line, err.problem) == (2, "not UTF-8 text")


def test_too_long_prompts_are_dropped_counted_and_logged(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "short"}, {"prompt": "x" * 50},
                                               {"prompt": "y" * 40}])
    with caplog.at_level(logging.WARNING, logger="engines.data.prompt_dataset"):
        loaded = load_prompt_samples(DatasetSpec(path, max_prompt_len=10), CharTokenizer())
    assert [s.prompt for s in loaded.samples] == ["short"]
    assert loaded.dropped_too_long == 2
    assert "dropped 2 of 3 prompts longer than 10 tokens" in caplog.text


def test_all_prompts_too_long_fails_with_the_count(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * 50}, {"prompt": "y" * 40}])
    err = load_error(DatasetSpec(path, max_prompt_len=10))
    assert "all 2 prompts are longer than 10 tokens" in err.problem


@pytest.mark.parametrize(("config_key", "named"), [
    ("data", "data.apply_chat_template"),
    ("eval.datasets[0]", "eval.datasets[0].apply_chat_template"),
])
def test_chat_template_message_names_the_specs_config_key(tmp_path, config_key, named):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    err = load_error(DatasetSpec(path, config_key=config_key))
    assert err.problem == f"chat messages need {named}: true"


def test_missing_key_names_the_specs_config_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "hi"}])
    err = load_error(DatasetSpec(path, config_key="eval.datasets[1]"))
    assert (err.line, err.field) == (1, "prompt")
    assert "eval.datasets[1].input_key" in err.problem


def test_messages_read_as_locations_in_the_file(tmp_path):
    """What a user reads first: the file, the line (a row for parquet) and the field, with
    no placeholders for a whole file or row and no line numbers of the JSON parser's own."""
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "ok"}\n{"prompt": "1+2=", "label": \n')
    assert str(load_error(DatasetSpec(str(bad_json)))) == (
        f"{bad_json}, line 2: not valid JSON at column 29: Expecting value")
    array = tmp_path / "train.json"
    array.write_text('[{"prompt": "ok"}]\n')
    assert str(load_error(DatasetSpec(str(array)))) == (
        f"{array}, line 1: a row must be a JSON object (one per line: JSON Lines, not a JSON "
        "array)")
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    assert str(load_error(DatasetSpec(empty))) == f"{empty}: no rows"
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "ok"}, {"prompt": ""}]), parquet)
    assert str(load_error(DatasetSpec(str(parquet)))) == (
        f"{parquet}, row 2, field 'prompt': empty prompt")


def test_all_prompts_too_long_fails_without_a_warning_first(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * 50}])
    with caplog.at_level(logging.WARNING, logger="engines.data.prompt_dataset"):
        load_error(DatasetSpec(path, max_prompt_len=10))
    assert "dropped" not in caplog.text


class NoTemplateTokenizer(CharTokenizer):
    chat_template = None


class StrictTemplateTokenizer(CharTokenizer):
    chat_template = "strict"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        if messages[0]["role"] == "system":
            raise ValueError("System role not supported")
        return super().apply_chat_template(messages, tokenize, add_generation_prompt)


def test_a_tokenizer_without_chat_template_names_the_key(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    with pytest.raises(DatasetError) as err:
        load_prompt_samples(DatasetSpec(path, apply_chat_template=True), NoTemplateTokenizer())
    assert "data.apply_chat_template is true, but the model's tokenizer has no chat template" in (
        str(err.value))


def test_a_row_the_chat_template_rejects_fails_with_its_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": [{"role": "user", "content": "hi"}]},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
    ])
    with pytest.raises(DatasetError) as err:
        load_prompt_samples(DatasetSpec(path, apply_chat_template=True),
                            StrictTemplateTokenizer())
    assert (err.value.line, err.value.field) == (2, "prompt")
    assert err.value.problem == ("the chat template cannot render it (data.apply_chat_template): "
                                 "ValueError: System role not supported")
