"""The bad inputs the probe tries, one mistake each, and what each is expected to do
(`early`, `loud`, `succeed`, `drop` or `report`; see `scripts/probe_bad_inputs.py`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

from bad_inputs.workspace import Workspace, base_config, setting


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    expect: str  # early | loud | succeed | drop | report
    build: Callable[[Workspace, str], list[str]]  # (workspace, run name) -> train arguments
    mentions: tuple[str, ...] = ()  # what the first line must name (case-insensitive)
    run_name: str | None = None


CASES: list[Case] = []


def case(name: str, what: str, expect: str, *mentions: str,
         run_name: str | None = None) -> Callable[[Callable[[Workspace, str], list[str]]], Any]:
    def register(build: Callable[[Workspace, str], list[str]]) -> Any:
        CASES.append(Case(name, what, expect, build, mentions, run_name))
        return build
    return register


def config_args(ws: Workspace, name: str, cfg: dict[str, Any] | str) -> list[str]:
    text = cfg if isinstance(cfg, str) else yaml.safe_dump(cfg, sort_keys=False)
    return ["--config", ws.write(f"configs/{name}.yaml", text)]


def bad_value(name: str, what: str, dotted: str, value: Any, *mentions: str,
              backend: str = "mock") -> None:
    """A case whose only mistake is one config value."""
    @case(name, what, "early", *(mentions or (dotted,)))
    def build(ws: Workspace, run: str) -> list[str]:
        return config_args(ws, run, setting(base_config(run, backend), dotted, value))


def bad_rows(name: str, what: str, edit: Callable[[list[dict[str, Any]]], list[Any]],
             *mentions: str, expect: str = "early", apply_chat_template: bool = False) -> None:
    """A case whose only mistake is in the training rows (the valid 64, edited)."""
    @case(name, what, expect, *mentions)
    def build(ws: Workspace, run: str) -> list[str]:
        cfg = setting(base_config(run), "data.prompt_data", ws.jsonl(f"cases/{run}.jsonl",
                                                                     edit(ws.rows())))
        if apply_chat_template:
            cfg = setting(cfg, "data.apply_chat_template", True)
        return config_args(ws, run, cfg)


def bad_hook(name: str, what: str, key: str, module: str | None, ref: str,
             *mentions: str, expect: str = "early", backend: str = "mock",
             extra: dict[str, Any] | None = None) -> None:
    """A case whose only mistake is a hook: `module` is written to ./<run>_hook.py (None:
    no file), `ref` is the import string, `{mod}` standing for that module's name."""
    @case(name, what, expect, *(mentions or (key,)))
    def build(ws: Workspace, run: str) -> list[str]:
        mod = f"{run}_hook"
        if module is not None:
            ws.write(f"{mod}.py", module)
        cfg = setting(base_config(run, backend), key, ref.format(mod=mod))
        for k, v in (extra or {}).items():
            cfg = setting(cfg, k, v)
        return config_args(ws, run, cfg)


def replace_row(index: int, row: Any) -> Callable[[list[dict[str, Any]]], list[Any]]:
    return lambda rows: rows[:index] + [row] + rows[index + 1:]


@case("baseline_ok", "the valid task (mock engine + trainer, 2 steps)", "succeed")
def _baseline(ws: Workspace, run: str) -> list[str]:
    return config_args(ws, run, base_config(run))


# -- data files

@case("jsonl_malformed_late", "row 60 of 64 is truncated JSON", "early", "line 60")
def _malformed(ws: Workspace, run: str) -> list[str]:
    lines = [json.dumps(r) for r in ws.rows()]
    lines[59] = lines[59][:20]
    path = ws.write(f"cases/{run}.jsonl", "\n".join(lines) + "\n")
    return config_args(ws, run, setting(base_config(run), "data.prompt_data", path))


bad_rows("jsonl_missing_input_key", "row 50 has 'question' instead of 'prompt'",
         replace_row(49, {"question": "1+2=", "label": "3"}), "line 50", "input_key")


@case("jsonl_empty_file", "the training file is empty (0 bytes)", "early", "no rows")
def _empty(ws: Workspace, run: str) -> list[str]:
    path = ws.write(f"cases/{run}.jsonl", "")
    return config_args(ws, run, setting(base_config(run), "data.prompt_data", path))


@case("jsonl_blank_lines_only", "the training file holds only blank lines", "early", "no rows")
def _blank(ws: Workspace, run: str) -> list[str]:
    path = ws.write(f"cases/{run}.jsonl", "\n  \n\n")
    return config_args(ws, run, setting(base_config(run), "data.prompt_data", path))


@case("json_array_file", "train.json holds one JSON array, not JSON lines", "early",
      "line 1")
def _json_array(ws: Workspace, run: str) -> list[str]:
    path = ws.write(f"cases/{run}.json", json.dumps(ws.rows()))
    return config_args(ws, run, setting(base_config(run), "data.prompt_data", path))


@case("non_utf8_file", "row 10 is Latin-1, not UTF-8", "early", "line 10")
def _latin1(ws: Workspace, run: str) -> list[str]:
    lines = [json.dumps(r).encode() for r in ws.rows()]
    lines[9] = '{"prompt": "caf\u00e9 1+2=", "label": "3"}'.encode("latin-1")
    path = ws.write(f"cases/{run}.jsonl", b"\n".join(lines) + b"\n")
    return config_args(ws, run, setting(base_config(run), "data.prompt_data", path))


@case("csv_file", "data.prompt_data is a .csv file", "early", ".csv")
def _csv(ws: Workspace, run: str) -> list[str]:
    path = ws.write(f"cases/{run}.csv", "prompt,label\n1+2=,3\n")
    return config_args(ws, run, setting(base_config(run), "data.prompt_data", path))


@case("parquet_wrong_columns", "parquet with columns question/answer, input_key 'prompt'",
      "early", "question", "input_key")
def _parquet(ws: Workspace, run: str) -> list[str]:
    rows = [{"question": r["prompt"], "answer": r["label"]} for r in ws.rows()]
    path = ws.parquet(f"cases/{run}.parquet", rows)
    return config_args(ws, run, setting(base_config(run), "data.prompt_data", path))


@case("paths_relative_to_config", "config in configs/ with paths relative to it, run from "
      "the workspace", "early", "data.prompt_data")
def _relative_to_config(ws: Workspace, run: str) -> list[str]:
    cfg = setting(base_config(run), "data.prompt_data", "../data/train.jsonl")
    cfg = setting(cfg, "engine.model_path", "../model")
    return config_args(ws, run, setting(cfg, "train.model_path", "../model"))


@case("data_path_typo", "data.prompt_data: data/trian.jsonl", "early", "data.prompt_data")
def _data_typo(ws: Workspace, run: str) -> list[str]:
    return config_args(ws, run, setting(base_config(run), "data.prompt_data", "data/trian.jsonl"))


# -- rows

bad_rows("empty_prompt", "row 7's prompt is ''", replace_row(6, {"prompt": "", "label": "1"}),
         "line 7", "empty")
bad_rows("whitespace_prompt", "row 7's prompt is '  \\n '",
         replace_row(6, {"prompt": "  \n ", "label": "1"}), "line 7", "empty")
bad_rows("chat_missing_role", "chat prompts, row 5's message has no 'role'",
         lambda rows: [{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
                       for r in rows[:4]] + [{"prompt": [{"content": "1+2="}], "label": "3"}]
         + rows[5:], "line 5", "role", apply_chat_template=True)
bad_rows("metadata_not_dict", "row 3's metadata is the string 'easy'",
         replace_row(2, {"prompt": "1+2=", "label": "3", "metadata": "easy"}), "line 3",
         "metadata")
bad_rows("label_not_scalar", "row 3's label is a list",
         replace_row(2, {"prompt": "1+2=", "label": [3]}), "line 3", "label")
bad_rows("label_column_missing", "no row has a label (exact_match reward; label is optional)",
         lambda rows: [{"prompt": r["prompt"]} for r in rows], expect="report")


@case("prompt_too_long", "4 of 64 prompts of 300 characters, 128-token model (embedded+torch)",
      "drop", "dropped")
def _too_long(ws: Workspace, run: str) -> list[str]:
    rows = ws.rows()
    for i in (3, 20, 40, 63):
        rows[i] = {**rows[i], "prompt": "1+" * 150}
    cfg = setting(base_config(run, "torch"), "data.prompt_data",
                  ws.jsonl(f"cases/{run}.jsonl", rows))
    return config_args(ws, run, cfg)


bad_rows("all_prompts_too_long", "every prompt is 300 characters (128-token model)",
         lambda rows: [{**r, "prompt": "1+" * 150} for r in rows], "no usable rows")


# -- hooks

bad_hook("rm_hook_unimportable", "rollout.custom_rm_path names a module that does not exist",
         "rollout.custom_rm_path", None, "no_such_reward:score",
         "rollout.custom_rm_path", "no_such_reward")
bad_hook("rm_hook_missing_function", "the reward module exists, the function does not",
         "rollout.custom_rm_path", "async def score(args, sample):\n    return 1.0\n",
         "{mod}:scroe", "rollout.custom_rm_path", "scroe")
bad_hook("rm_hook_import_error", "the reward module itself fails to import (missing package)",
         "rollout.custom_rm_path",
         "import no_such_package\n\nasync def score(args, sample):\n    return 1.0\n",
         "{mod}:score", "rollout.custom_rm_path", "no_such_package")
bad_hook("rm_hook_file_path", "custom_rm_path: 'myhook.py:score' (a file name, not a module)",
         "rollout.custom_rm_path", "async def score(args, sample):\n    return 1.0\n",
         "{mod}.py:score", "rollout.custom_rm_path")
bad_hook("filter_hook_unimportable", "dynamic_sampling_filter_path names a missing module",
         "rollout.dynamic_sampling_filter_path", None, "no_such_filters:keep",
         "rollout.dynamic_sampling_filter_path")
bad_hook("filter_builtin_typo", "dynamic filter 'check_reward_nonzero_stdd' (typo of a built-in)",
         "rollout.dynamic_sampling_filter_path", None, "check_reward_nonzero_stdd",
         "rollout.dynamic_sampling_filter_path")
bad_hook("rm_hook_wrong_signature", "reward hook `async def score(sample)` (one argument)",
         "rollout.custom_rm_path", "async def score(sample):\n    return 1.0\n", "{mod}:score",
         "rollout.custom_rm_path")
bad_hook("rm_hook_not_async", "reward hook is a plain `def`", "rollout.custom_rm_path",
         "def score(args, sample):\n    return 1.0\n", "{mod}:score", "rollout.custom_rm_path")
bad_hook("filter_hook_wrong_signature", "dynamic filter `def keep(group)` (one argument)",
         "rollout.dynamic_sampling_filter_path", "def keep(group):\n    return True\n",
         "{mod}:keep", "rollout.dynamic_sampling_filter_path")
bad_hook("group_rm_per_sample_hook", "group_rm: true with a per-sample `(args, sample)` hook",
         "rollout.custom_rm_path",
         "async def score(args, sample):\n    return float(sample.response.strip() == "
         "sample.label)\n", "{mod}:score", "group_rm", extra={"rollout.group_rm": True})
bad_hook("reward_raises", "reward hook raises ValueError at runtime (step 0)",
         "rollout.custom_rm_path",
         "async def score(args, sample):\n    raise ValueError('this reward is broken')\n",
         "{mod}:score", "this reward is broken", expect="loud")
bad_hook("reward_returns_none", "reward hook forgets to return (None)",
         "rollout.custom_rm_path",
         "async def score(args, sample):\n    float(sample.response == sample.label)\n",
         "{mod}:score", "reward", expect="loud")
bad_hook("reward_nan", "reward hook returns NaN for 1 sample in 5 (embedded+torch)",
         "rollout.custom_rm_path",
         "async def score(args, sample):\n    if sample.index % 5 == 0:\n"
         "        return float('nan')\n    return float(sample.response.strip() == "
         "sample.label)\n", "{mod}:score", "nan", expect="loud", backend="torch")

@case("grpo_one_sample_per_prompt", "grpo with n_samples_per_prompt: 1 (every advantage 0)",
      "early", "rollout.n_samples_per_prompt")
def _grpo_one(ws: Workspace, run: str) -> list[str]:
    return config_args(ws, run, setting(base_config(run), "rollout.n_samples_per_prompt", 1))


# -- rewards

bad_value("rm_type_unknown", "rollout.rm_type: exactmatch", "rollout.rm_type", "exactmatch")


@case("no_reward", "neither rollout.rm_type nor rollout.custom_rm_path", "early",
      "rollout.rm_type")
def _no_reward(ws: Workspace, run: str) -> list[str]:
    return config_args(ws, run, setting(base_config(run), "rollout.rm_type", None))


@case("eval_rm_type_unknown", "eval.datasets[0].rm_type: bogus", "early",
      "eval.datasets[0].rm_type")
def _eval_rm(ws: Workspace, run: str) -> list[str]:
    ds = [{"name": "test", "path": "data/test.jsonl", "rm_type": "bogus"}]
    return config_args(ws, run, setting(base_config(run), "eval.datasets", ds))


# -- eval sets

@case("eval_chat_no_template", "eval set of chat messages, no apply_chat_template", "early",
      "eval.datasets[0].apply_chat_template")
def _eval_chat(ws: Workspace, run: str) -> list[str]:
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}], "label": r["label"]}
            for r in ws.rows()[:8]]
    ds = [{"name": "chat", "path": ws.jsonl(f"cases/{run}.jsonl", rows)}]
    return config_args(ws, run, setting(base_config(run), "eval.datasets", ds))


@case("eval_path_typo", "eval.datasets[0].path: data/tset.jsonl", "early",
      "eval.datasets[0].path")
def _eval_typo(ws: Workspace, run: str) -> list[str]:
    ds = [{"name": "test", "path": "data/tset.jsonl"}]
    return config_args(ws, run, setting(base_config(run), "eval.datasets", ds))


# -- model

bad_value("model_path_typo", "train.model_path: modle (embedded+torch)", "train.model_path",
          "modle", "train.model_path", "modle", backend="torch")


@case("model_dir_without_weights", "model dir with config + tokenizer, no weights "
      "(embedded+torch)", "early", "model_path")
def _no_weights(ws: Workspace, run: str) -> list[str]:
    target = ws.root / "cases" / f"{run}-model"
    shutil.copytree(ws.root / "model", target,
                    ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    cfg = setting(base_config(run, "torch"), "train.model_path", f"cases/{run}-model")
    return config_args(ws, run, cfg)


@case("tokenizer_without_chat_template", "apply_chat_template: true, tokenizer has no "
      "chat template", "early", "chat")
def _no_template(ws: Workspace, run: str) -> list[str]:
    target = ws.root / "cases" / f"{run}-model"
    shutil.copytree(ws.root / "model", target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = target / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps({k: v for k, v in json.loads(tok_cfg.read_text()).items()
                                   if k != "chat_template"}))
    cfg = setting(base_config(run), "train.model_path", f"cases/{run}-model")
    cfg = setting(cfg, "engine.model_path", f"cases/{run}-model")
    return config_args(ws, run, setting(cfg, "data.apply_chat_template", True))


bad_value("max_response_len_beyond_context", "rollout.max_response_len: 200 (128-token model)",
          "rollout.max_response_len", 200)


# -- the config file itself

@case("config_file_typo", "--config grpo.yml (no such file)", "early", "grpo.yml")
def _config_typo(ws: Workspace, run: str) -> list[str]:
    return ["--config", "configs/grpo.yml"]


@case("yaml_invalid", "a YAML syntax error (unclosed flow mapping)", "early", "YAML")
def _yaml(ws: Workspace, run: str) -> list[str]:
    text = yaml.safe_dump(base_config(run), sort_keys=False)
    return config_args(ws, run, text.replace("rollout:\n", "rollout: {num_rollout: 2\n", 1))


bad_value("unknown_config_key", "rollout.num_rollouts (typo)", "rollout.num_rollouts", 2)
bad_value("unknown_section", "an 'optimizer' section", "optimizer.lr", 1e-4, "optimizer")
bad_value("wrong_type", "rollout.rollout_batch_size: 'four'", "rollout.rollout_batch_size",
          "four")
bad_value("engine_backend_typo", "engine.backend: sglan", "engine.backend", "sglan")


@case("set_override_wrong_type", "--set train.lr=1e-4x", "early", "train.lr")
def _set_override(ws: Workspace, run: str) -> list[str]:
    return [*config_args(ws, run, base_config(run)), "--set", "train.lr=1e-4x"]


@case("storage_uri_is_a_file", "storage.uri: data/train.jsonl (a file)", "early", "storage.uri")
def _storage_file(ws: Workspace, run: str) -> list[str]:
    return config_args(ws, run, setting(base_config(run), "storage.uri", "data/train.jsonl"))


# -- bounds

bad_value("save_interval_0", "train.save_interval: 0", "train.save_interval", 0)
bad_value("global_batch_size_neg", "train.global_batch_size: -5", "train.global_batch_size", -5)
bad_value("eval_interval_0", "eval.eval_interval: 0", "eval.eval_interval", 0)
bad_value("rollout_batch_size_0", "rollout.rollout_batch_size: 0", "rollout.rollout_batch_size",
          0)
bad_value("n_samples_per_prompt_0", "rollout.n_samples_per_prompt: 0",
          "rollout.n_samples_per_prompt", 0)
bad_value("num_rollout_0", "rollout.num_rollout: 0", "rollout.num_rollout", 0)
bad_value("temperature_neg", "rollout.temperature: -1", "rollout.temperature", -1.0)

# -- run names

bad_value("run_name_dotdot", "storage.run_name: '../x'", "storage.run_name", "../x")
bad_value("run_name_space", "storage.run_name: 'my run'", "storage.run_name", "my run")


@case("run_name_dotted", "storage.run_name: 'p-dot.v2' (valid)", "succeed", run_name="p-dot.v2")
def _dotted(ws: Workspace, run: str) -> list[str]:
    return config_args(ws, run, base_config(run))
