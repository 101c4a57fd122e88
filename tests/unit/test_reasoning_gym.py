"""reasoning-gym as a prompt source and a reward: `reasoning_gym://` URIs typed by the task's
config (bad ones named), rows that keep what the task's scorer needs through storage, the
reward graded by the task's own `score_answer`, and held-out sets that are held out."""

from __future__ import annotations

import json
import logging

import pytest
import reasoning_gym

from engines.data.prompt_dataset import (
    DatasetError,
    DatasetSpec,
    check_prompt_dataset,
    load_prompt_samples,
)
from engines.data.reasoning_gym import (
    TaskUriError,
    heldout_issue,
    parse_task_uri,
    shared_questions,
)
from engines.rollout.rewards.hub import RewardConfigError, builtin_reward
from engines.rollout.rewards.reasoning_gym import final_answer, score_entry, stored_entry
from flows.bookkeeping.preflight import preflight
from flows.config.loader import config_from_dict
from flows.config.run import ConfigError
from storage.arrow_schema import samples_to_table, table_to_samples
from storage.sample import RewardError, Sample
from tests.support.fakes import CharTokenizer

ADD = ("reasoning_gym://basic_arithmetic?size=20&seed=5&min_terms=2&max_terms=2&min_digits=2"
       "&max_digits=2&operators=+,-&allow_parentheses=false")


# -- URIs ------------------------------------------------------------------------------------
def test_query_values_are_typed_by_the_tasks_config():
    spec = parse_task_uri(ADD + "&format_style=natural&allow_negation=no")
    assert spec.task == "basic_arithmetic" and spec.seed == 5 and spec.size == 20
    assert spec.params["operators"] == ["+", "-"]  # `+` is a plus sign, not a space
    assert spec.params["allow_parentheses"] is False and spec.params["min_digits"] == 2
    assert spec.params["format_style"] == "natural"
    # percent-encoding, an optional left unset, a tuple field, the task's default size
    assert parse_task_uri("reasoning_gym://chain_sum?seed=1&max_terms=%33").params["max_terms"] == 3
    assert parse_task_uri("reasoning_gym://figlet_font?seed=1&static_word=none").params[
        "static_word"] is None
    assert parse_task_uri("reasoning_gym://countdown?seed=1&operators=+,*").params[
        "operators"] == ("+", "*")
    assert parse_task_uri("reasoning_gym://chain_sum?seed=1").size == 500


@pytest.mark.parametrize("uri, problem", [
    ("reasoning_gym://basic_arithmetc?seed=1", r"no reasoning-gym task 'basic_arithmetc'; did "
     r"you mean basic_arithmetic"),
    ("reasoning_gym://chain_sum?size=10", r"parameter 'seed' is required"),
    ("reasoning_gym://chain_sum?seed=one", r"parameter 'seed': expected an integer, got 'one'"),
    ("reasoning_gym://chain_sum?seed=1&min_terms=2.5", r"'min_terms': expected an integer"),
    ("reasoning_gym://chain_sum?seed=1&allow_negation=maybe",
     r"'allow_negation': expected true or false, got 'maybe'"),
    ("reasoning_gym://chain_sum?seed=1&digits=2", r"unknown parameter 'digits' for task "
     r"chain_sum; its parameters: min_terms, max_terms"),
    ("reasoning_gym://chain_sum?seed=1&seed=2", r"parameter 'seed' is given twice"),
    ("reasoning_gym://chain_sum?seed", r"parameter 'seed' has no value"),
    ("reasoning_gym://chain_sum?seed=1&size=0", r"'size' must be at least 1"),
    ("reasoning_gym://basic_arithmetic?seed=1&format_style=fancy",
     r"'format_style': expected one of simple, natural; got 'fancy'"),
    ("reasoning_gym://chain_sum?seed=1&min_terms=4&max_terms=2",
     r"task chain_sum rejects these parameters: AssertionError: max_terms must be >= min_terms"),
    ("reasoning_gym://rearc?seed=1&rng_difficulty_ranges=1,2",
     r"'rng_difficulty_ranges': its type, list\[tuple\[float, float\]\], cannot be written"),
])
def test_a_bad_uri_names_itself_and_the_parameter(uri, problem):
    with pytest.raises(TaskUriError, match=problem) as caught:
        parse_task_uri(uri)
    assert str(caught.value).startswith(f"{uri}: ")


def test_a_bad_uri_as_a_prompt_set_names_the_config_key():
    uri = "reasoning_gym://chain_sum?seed=1&digits=2"
    with pytest.raises(DatasetError, match=r"unknown parameter 'digits'.*\(data.prompt_data\)"):
        load_prompt_samples(DatasetSpec(uri), None)
    with pytest.raises(DatasetError, match=r"\(eval.datasets\[1\].path\)"):
        load_prompt_samples(DatasetSpec(uri, config_key="eval.datasets[1]"), None)


def test_a_task_whose_entries_do_not_survive_json_is_refused():
    # arc_agi's scorer compares tuples in the metadata with the parsed answer: stored as
    # JSON (lists) its own answer would score 0.05, so training on it would learn nothing.
    with pytest.raises(DatasetError, match=r"task arc_agi is not supported as a prompt source: "
                       r"its scorer gives its own answer 1.0 but 0.05"):
        load_prompt_samples(DatasetSpec("reasoning_gym://arc_agi?seed=1&size=2"), None)


# -- rows --------------------------------------------------------------------------------------
def test_rows_are_the_generators_entries_question_answer_and_entry():
    loaded = load_prompt_samples(DatasetSpec(ADD), CharTokenizer())
    generator = reasoning_gym.create_dataset(**{"name": "basic_arithmetic",
                                                **parse_task_uri(ADD).params})
    assert len(loaded.samples) == 20
    for i, s in enumerate(loaded.samples):
        entry = generator[i]
        assert s.prompt == entry["question"] and s.label == entry["answer"]
        assert s.tokens == CharTokenizer().encode(entry["question"])
        assert s.metadata["reasoning_gym"] == {"uri": ADD, "entry": json.loads(json.dumps(entry))}
        assert s.metadata["source_line"] == i + 1


def test_rows_go_through_the_chat_template_and_the_configured_keys():
    spec = DatasetSpec(ADD, input_key="q", label_key="a", metadata_key="m",
                       apply_chat_template=True)
    first = load_prompt_samples(spec, CharTokenizer()).samples[0]
    question = first.metadata["reasoning_gym"]["entry"]["question"]
    assert first.prompt == f"user:{question}|assistant:" and first.label is not None


def test_the_check_before_step_0_reads_every_generated_row():
    check = check_prompt_dataset(DatasetSpec(ADD), CharTokenizer())
    assert check.rows == 20 and check.fields.labelled == 20 and check.tokenized == 20


@pytest.mark.parametrize("uri", [
    ADD,
    "reasoning_gym://chain_sum?seed=3&size=6",
    "reasoning_gym://number_sorting?seed=3&size=6",
    "reasoning_gym://propositional_logic?seed=3&size=6",  # no single answer: graded by metadata
    "reasoning_gym://word_ladder?seed=3&size=4",
])
def test_stored_samples_score_as_the_generators_entries_do(uri):
    """Through the Arrow file a step writes: the entry the reward reads scores every answer
    as the generator's own entry does."""
    samples = load_prompt_samples(DatasetSpec(uri), None).samples
    restored = table_to_samples(samples_to_table(samples))
    generator = reasoning_gym.create_dataset(parse_task_uri(uri).task,
                                             **parse_task_uri(uri).params)
    for i, s in enumerate(restored):
        entry = generator[i]
        found_uri, stored = stored_entry(s)
        assert found_uri == uri
        for answer in {entry["answer"], "wrong", ""} - {None}:
            assert score_entry(uri, stored, f"<answer>{answer}</answer>") == \
                generator.score_answer(answer, entry)


# -- the reward --------------------------------------------------------------------------------
def test_the_final_answer_is_the_last_tagged_one_else_the_open_tag_else_the_whole_response():
    assert final_answer("think <answer>1</answer> no, <answer> 12 </answer>") == "12"
    assert final_answer("so <answer> 42") == "42"  # stopped at a `</answer>` stop string
    assert final_answer("  42\n") == "42"  # no tags: a model trained to answer directly
    assert final_answer("") == ""


def test_the_reward_is_the_tasks_own_score():
    sample = load_prompt_samples(DatasetSpec(ADD), None).samples[0]
    uri, entry = stored_entry(sample)
    answer = entry["answer"]
    assert score_entry(uri, entry, f"<think>easy</think><answer>{answer}</answer>") == 1.0
    assert score_entry(uri, entry, answer) == 1.0
    assert score_entry(uri, entry, f"<answer>{int(answer) + 1}</answer>") == 0.0
    # malformed answers: what basic_arithmetic's scorer gives them (0, or partial credit
    # when the right answer is inside a longer one)
    assert score_entry(uri, entry, "<answer></answer>") == 0.0
    assert score_entry(uri, entry, "<answer>nonsense</answer>") == 0.0
    assert score_entry(uri, entry, f"<answer>{answer}0</answer>") == pytest.approx(
        len(answer) / (len(answer) + 1))


def test_a_sample_without_an_entry_is_a_reward_error_naming_it():
    sample = Sample(index=7, group_index=0, prompt="1+1=", label="2",
                    metadata={"source_line": 3})
    with pytest.raises(RewardError, match=r"sample 7 \(prompt line 3\): rm_type reasoning_gym "
                       r"grades prompts of a reasoning_gym://"):
        stored_entry(sample)


def test_reasoning_gym_is_a_builtin_reward():
    assert builtin_reward("reasoning_gym", "rollout.rm_type").__name__ == "reasoning_gym"
    with pytest.raises(RewardConfigError, match=r"rollout.rm_type: the boxed_ prefix applies "
                       r"to rule rewards only"):
        builtin_reward("boxed_reasoning_gym", "rollout.rm_type")
    with pytest.raises(RewardConfigError, match=r"'reasoning_gym'"):
        builtin_reward("reasoning_gm", "rollout.rm_type")


# -- held-out sets -----------------------------------------------------------------------------
def uri(seed: int, size: int, extra: str = "") -> str:
    return f"reasoning_gym://chain_sum?seed={seed}&size={size}&max_terms=3{extra}"


def test_an_eval_set_on_the_training_sets_random_streams_is_no_held_out_set():
    same = heldout_issue(uri(1, 100), uri(1, 10))
    assert same is not None and same.same_entries
    assert same.message.startswith("10 of its 10 entries are training entries")
    near = heldout_issue(uri(1, 100), uri(95, 10))  # streams 95..104 against 1..100
    assert near is not None and near.same_entries and "6 of its 10 entries" in near.message
    assert "pick a seed outside -8..100" in near.message
    other_settings = heldout_issue(uri(1, 100), uri(1, 10, "&min_digits=2"))
    assert other_settings is not None and not other_settings.same_entries
    assert heldout_issue(uri(1, 100), uri(101, 10)) is None
    assert heldout_issue(uri(1, 100), "reasoning_gym://basic_arithmetic?seed=1&size=5") is None
    assert heldout_issue(uri(1, 100), "test.jsonl") is None


def test_questions_a_small_problem_space_repeats_across_seeds_are_counted():
    small = "reasoning_gym://chain_sum?size={}&seed={}&min_terms=2&max_terms=2&max_digits=1"
    shared, total = shared_questions(small.format(400, 1000), small.format(50, 5000))
    assert total == 50 and 0 < shared <= 50  # 10 x 10 x 2 problems: most repeat
    assert shared_questions(ADD, ADD.replace("seed=5", "seed=100000"))[0] < 20


def test_preflight_refuses_an_eval_set_of_training_entries_and_warns_of_shared_questions(
        tiny_model_dir, tmp_path, caplog):
    small = "reasoning_gym://chain_sum?size={}&seed={}&min_terms=2&max_terms=2&max_digits=1"

    def config(eval_uri: str):
        return config_from_dict({
            "data": {"prompt_data": small.format(200, 1)},
            "rollout": {"num_rollout": 1, "rollout_batch_size": 2, "n_samples_per_prompt": 2,
                        "max_response_len": 8, "rm_type": "reasoning_gym"},
            "train": {"model_path": tiny_model_dir},
            "storage": {"uri": str(tmp_path / "runs"), "run_name": "rg"},
            "eval": {"datasets": [{"name": "heldout", "path": eval_uri}]},
        })

    with pytest.raises(ConfigError, match=r"eval.datasets\[0\].path: reasoning_gym://chain_sum"
                       r".* is not held out: 20 of its 20 entries are training entries"):
        preflight(config(small.format(20, 150)))
    with caplog.at_level(logging.WARNING, logger="flows.bookkeeping.preflight"):
        report = preflight(config(small.format(20, 999)))
    assert report.eval_prompts == {"heldout": 20}
    assert "of its 20 questions also occur in the training set" in caplog.text
