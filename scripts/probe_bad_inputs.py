"""Probe `rollflow train` with one bad input at a time, the way a user meets them.

Issue 9 asks for a table of bad inputs: when each fails (seconds; before or after step 0)
and the first line it prints. This script makes that table, reproducibly. In a fresh temp
directory outside the repository it writes a small valid task (a tiny 2-layer Llama, 64
two-digit additions), then for each case a config and data with exactly one mistake, runs
`rollflow train --config <file>` there as a subprocess with relative paths, as a user does,
and records: wall seconds until exit, the exit code, how far the run got (what exists under
`runs/<run>/`: config.yaml, steps/*, steps/*/COMMITTED), the raw first line of stderr, and
the first line that is not Ray/Prefect/tqdm/library-warning noise.

Most cases run the mock engine and trainer (fast); those that need a real model (prompts
longer than its context, a NaN reward, a model directory without weights) run embedded +
torch. The local Ray head is the user's default: the first case starts it on demand
(ROLLFLOW_HOME is the temp directory's, so it is this probe's own head) and the others attach
to it; a run that failed after its actors started is stopped with `rollflow runs stop`. At the
end `rollflow cluster down` stops the head and the temp directory is removed.

    .venv/bin/python scripts/probe_bad_inputs.py                   # every case (~15 min here)
    .venv/bin/python scripts/probe_bad_inputs.py --only empty_prompt --only yaml_invalid
    .venv/bin/python scripts/probe_bad_inputs.py --list            # the cases, what each expects

Each case says what it expects, and the last column judges the outcome against it:
`early` (fails before Prefect and the actors start, the first line naming the key, file or
line at fault), `loud` (fails, possibly mid-step, naming the cause), `succeed`, `drop` (runs,
prompts over the context dropped and counted) or `report` (no rule: shown as it is).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
ROLLFLOW = str(Path(sys.executable).with_name("rollflow"))
N_TRAIN = 64

# Lines that are not rollflow talking: Ray's Python and C++ logs, Ray worker prefixes,
# Prefect's console logs and temporary-server notices, tqdm bars, library warnings.
NOISE = [re.compile(p) for p in (
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(DEBUG|INFO|WARNING)\s+\S+\.py:\d+ -- ",
    r"^\[\d{4}-\d\d-\d\d [\d:,.]+ [DIWE] \d+ \d+\] \S+\.(cc|h):\d+",
    r"^\((raylet|pid=\d+|\w+ pid=\d+)",
    r"^\d\d:\d\d:\d\d\.\d+ \| \w+ *\| (prefect[\w.]*|Flow run|Task run) ",
    r"(Starting|Stopping) temporary server|docs\.prefect\.io",
    r"\d+%\|.*\|",
    r"/(site|dist)-packages/.*\w+Warning: ",
    r"^\s+warnings\.warn\(",
)]
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def stderr_lines(text: str) -> list[str]:
    """Non-empty lines, tqdm's carriage-return redraws split apart, colours removed."""
    return [ln.strip() for ln in re.split(r"[\r\n]+", _ANSI.sub("", text)) if ln.strip()]


def first_line(text: str) -> tuple[str, str]:
    """(raw first line, first line that is not noise) of a stderr text."""
    lines = stderr_lines(text)
    meaningful = [ln for ln in lines if not any(p.search(ln) for p in NOISE)]
    return (lines[0] if lines else ""), (meaningful[0] if meaningful else "")


# ---------------------------------------------------------------------------- the workspace


class Workspace:
    """The temp directory the user works in: model, data, hooks, configs; runs under ./runs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "home"  # ROLLFLOW_HOME: this probe's own Ray head, token and logs
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("RAY_", "PREFECT_API", "ROLLFLOW_"))}
        self.env.update(ROLLFLOW_HOME=str(self.home), PREFECT_HOME=str(root / "prefect"),
                        TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        # Prefect gives its ephemeral server 20 s (counted in 0.1 s sleeps, so longer in
        # fact) to start; on a loaded machine it times out, which is not what a case probes.
        self.env.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
        self.notes: list[str] = []

    def path(self, rel: str) -> Path:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def write(self, rel: str, content: str | bytes) -> str:
        p = self.path(rel)
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
        return rel

    def jsonl(self, rel: str, rows: list[Any]) -> str:
        return self.write(rel, "".join(json.dumps(r) + "\n" for r in rows))

    def parquet(self, rel: str, rows: list[dict[str, Any]]) -> str:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), self.path(rel))
        return rel

    def rows(self) -> list[dict[str, Any]]:
        text = (self.root / "data/train.jsonl").read_text()
        return [json.loads(ln) for ln in text.splitlines()]

    def setup(self) -> None:
        """The valid task every case starts from (built in this process, from the repo)."""
        from examples.arithmetic.build_model import save_tiny_model
        from examples.arithmetic.make_data import write_datasets

        here = os.getcwd()
        os.chdir(self.root)
        try:
            save_tiny_model("model", num_layers=2, hidden_size=64)  # 128-token context
            write_datasets("data", n_train=N_TRAIN, n_test=16)
        finally:
            os.chdir(here)

    def run(self, args: list[str], timeout: float) -> tuple[int | None, float, str, str]:
        """`rollflow *args` from the workspace: (exit code or None on timeout, seconds,
        stdout, stderr). Its own session, so a timeout stops the driver and its children."""
        start = time.perf_counter()
        proc = subprocess.Popen([ROLLFLOW, *args], cwd=self.root, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            rc = None
        except BaseException:  # interrupted: the driver must not outlive the probe
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        return rc, time.perf_counter() - start, out, err


def base_config(run: str, backend: str = "mock") -> dict[str, Any]:
    """A valid config for the workspace task: mock engine and trainer (the model directory
    gives the tokenizer and context), or embedded engine + torch trainer (the engine takes
    train.model_path, as a user would leave it)."""
    torch = backend == "torch"
    engine = {"backend": "embedded"} if torch else {"backend": "mock", "model_path": "model"}
    return {
        "cluster": {"actor_num_threads": 1},
        "data": {"prompt_data": "data/train.jsonl"},
        "rollout": {"num_rollout": 2, "rollout_batch_size": 4, "n_samples_per_prompt": 2,
                    "max_response_len": 4, "rm_type": "exact_match", "use_router": False},
        "engine": engine,
        "train": {"backend": "torch" if torch else "mock", "model_path": "model", "lr": 1e-4},
        "storage": {"uri": "./runs", "run_name": run},
        "eval": {"before_train": False},
    }


def setting(cfg: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of `cfg` with `a.b.c` set (None deletes the key)."""
    cfg = copy.deepcopy(cfg)
    *parents, last = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value
    return cfg


# ---------------------------------------------------------------------------- the cases


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
bad_hook("reward_nan", "reward hook returns NaN for 1 sample in 5 (embedded+torch; issue 10)",
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


# ---------------------------------------------------------------------------- running them


@dataclass
class Outcome:
    case: str
    what: str
    expect: str
    seconds: float
    exit_code: int | None  # None: killed at the timeout
    phase: str
    committed: list[int]
    first_line: str
    raw_first_line: str
    verdict: str
    log_lines: list[str] = field(default_factory=list)  # meaningful stderr, for the record


def progress(run_dir: Path, rc: int | None, err: str) -> tuple[str, list[int]]:
    """How far the run got, from what it left in storage (and whether it reached Ray)."""
    steps = run_dir / "steps"
    committed = sorted(int(p.parent.name) for p in steps.glob("*/COMMITTED"))
    started = sorted(int(p.name) for p in steps.glob("[0-9]*") if p.is_dir())
    if rc == 0:
        return f"finished ({len(committed)} steps)", committed
    if not (run_dir / "config.yaml").exists():
        if "Connecting to existing Ray cluster" in err:
            return "before step 0 (connecting to Ray)", committed
        return "before step 0 (preflight)", committed
    if not started:
        return "before step 0 (actor start)", committed
    current = max(started)
    if current in committed:
        return f"after step {current} (between steps)", committed
    after = f", after step {max(committed)}" if committed else ""
    return f"in step {current}{after}", committed


def judge(c: Case, rc: int | None, phase: str, line: str, out: str, err: str) -> str:
    if rc is None:
        return "TIMEOUT"
    missing = [m for m in c.mentions if m.lower() not in line.lower()]
    if c.expect == "succeed":
        return "ok" if rc == 0 else "FAILED (should run)"
    if c.expect == "report":
        return "report"
    if c.expect == "drop":
        dropped = re.search(r'"prompts_dropped_too_long": (\d+)', out)
        if rc != 0:
            return "FAILED (should run, dropping)"
        if not dropped or dropped.group(1) == "0":
            return "NOT DROPPED"
        return "ok" if "dropped" in err else "ok (silent: no warning)"
    if rc == 0:
        return "NO FAILURE"
    late = c.expect == "early" and "preflight" not in phase
    verdict = [f"LATE ({phase})"] if late else []
    if missing:
        verdict.append(f"UNCLEAR (no {', '.join(repr(m) for m in missing)})")
    return "; ".join(verdict) or "ok"


def run_case(ws: Workspace, c: Case, timeout: float) -> Outcome:
    run = c.run_name or c.name
    args = ["train", *c.build(ws, run)]
    rc, seconds, out, err = ws.run(args, timeout)
    (ws.root / "logs").mkdir(exist_ok=True)
    (ws.root / "logs" / f"{c.name}.stderr").write_text(err)
    (ws.root / "logs" / f"{c.name}.stdout").write_text(out)
    raw, line = first_line(err)
    phase, committed = progress(ws.root / "runs" / run, rc, err)
    if rc != 0 and "preflight" not in phase:
        ws.run(["runs", "stop", run], 120)  # a run failed mid-step keeps its actors
    meaningful = [ln for ln in stderr_lines(err) if not any(p.search(ln) for p in NOISE)]
    return Outcome(c.name, c.what, c.expect, round(seconds, 1), rc, phase, committed, line,
                   raw, judge(c, rc, phase, line, out, err), meaningful[:5])


def auth_workaround(ws: Workspace, outcome: Outcome) -> bool:
    """rollflow's CLI cannot attach to the token-auth head it starts when Ray read its auth
    mode (at import) before flows.cluster set it: every run then fails in ray.init. Record
    that, and go on with the token handed in through the environment, so the other cases
    still say something."""
    if "AuthenticationError" not in outcome.first_line:
        return False
    ws.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(ws.home / "ray_token"))
    ws.notes.append(
        f"`{outcome.case}` failed with the plain environment ({outcome.first_line[:90]}...) "
        f"after {outcome.seconds} s: the rest ran with RAY_AUTH_MODE=token and "
        "RAY_AUTH_TOKEN_PATH=$ROLLFLOW_HOME/ray_token set by the probe."
    )
    return True


def cell(text: str, width: int = 220) -> str:
    text = text.replace("|", "\\|")
    return text if len(text) <= width else text[: width - 3] + "..."


def table(outcomes: list[Outcome]) -> str:
    rows = ["| case | fails after (s) | before/after step 0 | exit code | first line | verdict |",
            "|---|---|---|---|---|---|"]
    for o in outcomes:
        seconds = f"{o.seconds:.1f}" if o.exit_code != 0 else f"(ran {o.seconds:.1f})"
        rc = "timeout" if o.exit_code is None else str(o.exit_code)
        line = f"`{cell(o.first_line)}`" if o.first_line else "(nothing)"
        rows.append(f"| {o.case} | {seconds} | {o.phase} | {rc} | {line} | {o.verdict} |")
    raw = [o for o in outcomes if o.raw_first_line != o.first_line]
    if raw:
        rows += ["", "Raw first line of stderr, where it differs:", "",
                 "| case | raw first stderr line |", "|---|---|"]
        rows += [f"| {o.case} | `{cell(o.raw_first_line, 160)}` |" for o in raw]
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="CASE",
                        help="run only these cases (repeatable; baseline_ok always runs first)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per case")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temp directory (logs/<case>.stderr) and the Ray head")
    parser.add_argument("--json", metavar="PATH", help="also write the outcomes as JSON")
    parser.add_argument("--logs", metavar="DIR",
                        help="copy each case's stdout/stderr here before the cleanup")
    args = parser.parse_args()
    # `kill PID` (and SIGINT, which a background job ignores) still cleans up below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.list:
        for c in CASES:
            print(f"{c.name:34} {c.expect:8} {c.what}")
        return 0
    unknown = set(args.only) - {c.name for c in CASES}
    if unknown:
        parser.error(f"unknown cases: {sorted(unknown)} (see --list)")
    cases = [c for c in CASES if not args.only or c.name in args.only or c.name == "baseline_ok"]

    ws = Workspace(Path(tempfile.mkdtemp(prefix="rfprobe-", dir="/tmp")))  # short: Ray sockets
    if ws.root.resolve().is_relative_to(REPO):
        raise SystemExit("the probe's directory must be outside the repository")
    print(f"probe directory: {ws.root} ({len(cases)} cases)", file=sys.stderr)
    start = time.perf_counter()
    outcomes: list[Outcome] = []
    try:
        ws.setup()
        for c in cases:
            outcome = run_case(ws, c, args.timeout)
            if c.name == "baseline_ok" and auth_workaround(ws, outcome):
                outcomes.append(outcome)
                outcome = run_case(ws, Case("baseline_ok_with_token", c.what, c.expect,
                                            c.build, run_name="baseline-token"), args.timeout)
            outcomes.append(outcome)
            o = outcome
            print(f"  {o.case}: rc={o.exit_code} {o.seconds:.1f}s {o.phase}: "
                  f"{o.first_line[:100]} [{o.verdict}]", file=sys.stderr)
    finally:
        total = time.perf_counter() - start
        if args.logs and (ws.root / "logs").is_dir():
            shutil.copytree(ws.root / "logs", args.logs, dirs_exist_ok=True)
        if not args.keep:
            ws.run(["cluster", "down"], 120)
            shutil.rmtree(ws.root, ignore_errors=True)
        report(outcomes, ws.notes, total, args.json)  # interrupted too: what ran so far
    return 0


def report(outcomes: list[Outcome], notes: list[str], total: float, json_path: str | None
           ) -> None:
    print(table(outcomes))
    for note in notes:
        print(f"\nNote: {note}")
    print(f"\n{len(outcomes)} cases in {total:.0f} s")
    if json_path:
        Path(json_path).write_text(json.dumps(
            {"seconds": round(total, 1), "notes": notes,
             "outcomes": [asdict(o) for o in outcomes]}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
