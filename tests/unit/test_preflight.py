"""Checks that run in the driver before any actor starts (no Ray, no Prefect)."""

from __future__ import annotations

import json

import pytest

from engines.data.prompt_dataset import DatasetError
from engines.hooks.loader import HookError
from engines.rollout.rewards.hub import RewardConfigError
from flows.bookkeeping.preflight import preflight
from flows.config.loader import config_from_dict
from flows.config.run import ConfigError


@pytest.fixture
def make(tmp_path, tiny_model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n"
                            for i in range(8)))

    def build(**sections):
        raw = {
            "data": {"prompt_data": str(data)},
            "rollout": {"num_rollout": 1, "rollout_batch_size": 2, "rm_type": "exact_match",
                        "n_samples_per_prompt": 2,
                        "max_response_len": 8},
            "train": {"model_path": tiny_model_dir},
            "storage": {"uri": str(tmp_path / "runs"), "run_name": "pf"},
        }
        for name, values in sections.items():
            raw.setdefault(name, {}).update(values)
        return config_from_dict(raw)

    return build, data


def test_a_clean_config_passes_and_gets_the_models_prompt_limit(make):
    build, _ = make
    report = preflight(build())
    assert report.prompts == 8 and report.dropped_too_long == 0
    assert report.max_prompt_len == 128 - 8  # tiny model: 128 positions


def test_prompts_longer_than_the_context_are_dropped_and_counted(make):
    build, data = make
    with data.open("a") as f:
        f.write(json.dumps({"prompt": "1+" * 250, "label": "x"}) + "\n")
    report = preflight(build())
    assert report.dropped_too_long == 1 and report.prompts == 8


def test_a_response_budget_over_the_context_is_a_config_error(make):
    build, _ = make
    with pytest.raises(ConfigError, match=r"rollout.max_response_len=200 leaves no room"):
        preflight(build(rollout={"max_response_len": 200}))


def test_no_reward_function_is_named_before_step_0(make):
    build, _ = make
    with pytest.raises(ConfigError, match=r"rollout.rm_type: no reward function.*line 1"):
        preflight(build(rollout={"rm_type": None}))
    with pytest.raises(RewardConfigError, match=r"rollout.rm_type: unknown reward 'exact'"):
        preflight(build(rollout={"rm_type": "exact"}))


def test_an_unimportable_hook_is_named_before_step_0(make):
    build, _ = make
    with pytest.raises(HookError, match=r"rollout.custom_rm_path: cannot import 'nowhere'"):
        preflight(build(rollout={"custom_rm_path": "nowhere:score"}))


def test_eval_set_errors_name_their_own_keys(make, tmp_path):
    build, _ = make
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(DatasetError, match=r"eval.datasets\[1\].apply_chat_template"):
        preflight(build(eval={"datasets": [{"name": "a", "path": str(chat),
                                            "apply_chat_template": True},
                                           {"name": "b", "path": str(chat)}]}))
    with pytest.raises(ValueError, match=r"eval.datasets\[0\].rm_type: unknown reward"):
        preflight(build(eval={"datasets": [{"name": "a", "path": str(chat), "rm_type": "nope"}]}))


def test_a_model_that_does_not_load_names_its_key(make, tmp_path):
    build, _ = make
    (tmp_path / "empty-model").mkdir()
    (tmp_path / "empty-model" / "model.safetensors").write_bytes(b"")  # weights, no tokenizer
    # the key the user set, not engine.model_path (which defaults to it)
    with pytest.raises(ConfigError, match=r"^train.model_path: cannot load a tokenizer"):
        preflight(build(train={"model_path": str(tmp_path / "empty-model")}))
    with pytest.raises(ConfigError, match=r"^engine.model_path: cannot load a tokenizer"):
        preflight(build(engine={"model_path": str(tmp_path / "empty-model")}))


def test_an_unwritable_storage_root_is_named(make, tmp_path):
    build, _ = make
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"storage.uri: cannot write"):
        preflight(build(storage={"uri": str(blocker)}))


def test_missing_inputs_are_all_named_by_key(make, tmp_path):
    build, _ = make
    with pytest.raises(ConfigError) as err:
        preflight(build(data={"prompt_data": str(tmp_path / "tain.jsonl")},
                        eval={"datasets": [{"name": "t", "path": str(tmp_path / "tst.jsonl")}]}))
    assert str(err.value).splitlines() == [
        f"data.prompt_data: no such file or directory: {tmp_path / 'tain.jsonl'}",
        f"eval.datasets[0].path: no such file or directory: {tmp_path / 'tst.jsonl'}",
    ]


def test_a_public_engine_address_is_warned_about(make, caplog):
    build, _ = make
    preflight(build(engine={"host": "0.0.0.0"}))
    assert any("engine.host=0.0.0.0: reachable from the network" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    preflight(build())
    assert not any("reachable from the network" in r.getMessage() for r in caplog.records)


def test_a_model_directory_without_weights_is_named_before_any_actor(make, tmp_path,
                                                                      tiny_model_dir):
    import shutil

    build, _ = make
    no_weights = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, no_weights,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    with pytest.raises(ConfigError, match=r"train.model_path: .*no-weights has no model weights"):
        preflight(build(train={"model_path": str(no_weights)}))


def test_a_model_typo_names_the_key_the_user_set_once(make, tmp_path):
    build, _ = make
    with pytest.raises(ConfigError) as err:
        preflight(build(train={"model_path": str(tmp_path / "modle")}))
    assert str(err.value) == f"train.model_path: no such file or directory: {tmp_path / 'modle'}"


def test_a_rule_reward_on_prompts_without_the_label_field_fails_naming_file_and_key(
        make, tmp_path):
    """exact_match compares responses with the label: a set whose answers sit under another
    field would score every response 0 and train on nothing, without a word."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    build, data = make
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError) as raised:
        preflight(build())
    assert str(raised.value) == (
        f"{data}: no row has the label field 'label' (data.label_key), but the reward (rm_type "
        "'exact_match') compares each response with the label, so every reward would be 0; set "
        "data.label_key to the field that holds the answers (its rows have: prompt, answer)")
    assert preflight(build(data={"label_key": "answer"})).prompts == 8
    with pytest.raises(DatasetError, match=r"data.label_key is unset, but the reward"):
        preflight(build(data={"label_key": None, "prompt_data": str(data)}))
    # A reward of the user's own may not need a label: not refused.
    assert preflight(build(rollout={"custom_rm_path": "tests.support.hooks:reward_exact"})).prompts

    shards = tmp_path / "shards"
    shards.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), shards / "part-0.parquet")
    with pytest.raises(DatasetError, match=r"part-0.parquet|shards.*label field 'label'"):
        preflight(build(data={"prompt_data": str(shards)}))
    # ... and so does each row's own metadata.rm_type rule
    tagged = tmp_path / "tagged.jsonl"
    tagged.write_text("".join(json.dumps({**r, "metadata": {"rm_type": "math"}}) + "\n"
                              for r in rows))
    with pytest.raises(DatasetError, match=r"reward \(metadata.rm_type 'math' \(.*line 1\)\)"):
        preflight(build(data={"prompt_data": str(tagged)}, rollout={"rm_type": None}))


def test_an_eval_set_without_labels_names_its_own_key(make, tmp_path):
    build, _ = make
    bare = tmp_path / "test.jsonl"
    bare.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    with pytest.raises(DatasetError, match=r"eval.datasets\[0\].label_key\), but the reward"):
        preflight(build(eval={"datasets": [{"name": "t", "path": str(bare)}]}))


def test_a_model_family_no_backend_runs_is_refused_by_name(make, tmp_path):
    from transformers import MistralConfig

    from engines.weights.model_families import UnsupportedModelError, check_model_config

    build, _ = make
    mistral = tmp_path / "mistral"
    MistralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1).save_pretrained(mistral)
    (mistral / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        preflight(build(train={"model_path": str(mistral)}))
    # the trainer and the embedded engine (which defaults to the trainer's model) both refuse
    assert str(err.value).splitlines() == [
        f"train.model_path ({mistral}): model_type 'mistral' is not supported by the torch "
        "train backend; supported: llama, qwen2, qwen3, qwen3_moe",
        f"engine.model_path ({mistral}): model_type 'mistral' is not supported by the "
        "embedded engine; supported: llama, qwen2, qwen3, qwen3_moe",
    ]
    # a backend built without the driver refuses too
    with pytest.raises(UnsupportedModelError, match="'mistral' is not supported by the "
                       "megatron train backend; supported: llama, qwen2, qwen3, qwen3_moe$"):
        check_model_config(type("Cfg", (), {"model_type": "mistral"})(), "megatron", "x")
