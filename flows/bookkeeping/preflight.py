"""Everything that can be checked before step 0, checked in the driver, in seconds.

Without this, a bad row, an unimportable hook or an eval-set mistake surfaced only inside an
actor's constructor (after the models loaded) or after the last training step, wrapped in Ray
and Prefect tracebacks. Each check names the config key, or the file, line and field, at
fault. It also counts what the rollout actor will drop: prompts longer than the model's
context minus `rollout.max_response_len` (the default of `data.rollout_max_prompt_len`), as
slime drops them, instead of generating empty responses.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from engines.chat.tokenizer import load_tokenizer
from engines.cluster.head import warn_if_public
from engines.config.rollout import is_environment_uri
from engines.data.prompt_checks import FieldReport
from engines.data.prompt_dataset import (
    DatasetCheck,
    DatasetError,
    DatasetSpec,
    check_prompt_dataset,
    data_spec,
    model_context,
    prompt_limit,
)
from engines.data.reasoning_gym import heldout_issue, is_task_uri, shared_questions
from engines.hooks.loader import load_hook, validate_hooks
from engines.hooks.protocols import RewardFn
from engines.rollout.evaluation import eval_spec
from engines.rollout.rewards.hub import RewardHub, builtin_reward, compares_with_label
from engines.weights.model_families import UnsupportedModelError, check_model_family
from flows.config.paths import MODEL_FIELDS, is_uri
from flows.config.run import ConfigError, EvalDataset, RollflowConfig
from storage.run_layout import RunLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreflightReport:
    """What the checks found: usable prompts per dataset and the prompts dropped as too long."""

    prompts: int
    dropped_too_long: int
    max_prompt_len: int | None
    eval_prompts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def model_dir(cfg: RollflowConfig) -> tuple[str, str] | None:
    """(config key, path) of the model whose tokenizer and context the run uses."""
    for key, path in (("engine.model_path", cfg.engine.model_path),
                      ("train.model_path", cfg.train.model_path), ("train.load", cfg.train.load)):
        if path:
            if key == "engine.model_path" and path == cfg.train.model_path:
                key = "train.model_path"  # the key the user set (the engine's defaults to it)
            return key, path
    return None


def load_tokenizer_and_context(cfg: RollflowConfig) -> tuple[Any, int | None]:
    """The run's tokenizer and the model's context length (None: no model, e.g. mock)."""
    found = model_dir(cfg)
    if found is None:
        return None, None
    key, path = found
    try:
        return load_tokenizer(path), model_context(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}: cannot load a tokenizer and model config from {path!r}: "
                          f"{str(e).splitlines()[0]}") from None


def checked_prompt_limit(cfg: RollflowConfig, context: int | None) -> int | None:
    """The prompt limit the rollout actor will apply (`engines.data.prompt_dataset.prompt_limit`);
    a config error when no prompt fits."""
    limit = prompt_limit(cfg.data.rollout_max_prompt_len, context, cfg.rollout.max_response_len)
    if limit is not None and limit < 1:
        raise ConfigError(
            f"rollout.max_response_len={cfg.rollout.max_response_len} leaves no room for a "
            f"prompt in the model's context of {context} tokens"
        )
    return limit


def _check(cfg: RollflowConfig, spec: DatasetSpec, tokenizer: Any) -> DatasetCheck:
    return check_prompt_dataset(spec, tokenizer, cfg.data.preflight_token_rows)


def is_pattern(path: str) -> bool:
    """A glob of shards (`data/train-*.parquet`): it exists when it matches something."""
    return any(c in path for c in "*?[")


def input_files(cfg: RollflowConfig) -> dict[str, str]:
    """Config key -> local file, directory or glob the run reads (URIs and hub ids excluded)."""
    files = {"data.prompt_data": cfg.data.prompt_data}
    files.update({f"eval.datasets[{i}].path": ds.path for i, ds in enumerate(cfg.eval.datasets)})
    if cfg.rollout.debug_rollout_data:
        files["rollout.debug_rollout_data"] = cfg.rollout.debug_rollout_data
    for section in ("train", "engine", "algorithm"):  # train first: the key users set
        for name in MODEL_FIELDS[section]:
            path = getattr(getattr(cfg, section), name)
            if path and os.path.isabs(path) and path not in files.values():
                files[f"{section}.{name}"] = path  # (hub ids stay relative; named once)
    return {key: path for key, path in files.items() if not is_uri(path)}


def check_files_exist(cfg: RollflowConfig) -> None:
    missing = [f"{key}: no such file or directory: {path}"
               for key, path in input_files(cfg).items()
               if not (glob.glob(path) if is_pattern(path) else os.path.exists(path))]
    if missing:
        raise ConfigError("\n".join(missing))


WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin")


def check_model_weights(cfg: RollflowConfig) -> None:
    """Each local model directory holds weights (a config and tokenizer alone pass the
    tokenizer load, then an actor fails a minute later)."""
    if cfg.train.backend == "mock" and cfg.engine.backend != "embedded":
        return
    for key, path in input_files(cfg).items():
        if key.split(".")[0] in MODEL_FIELDS and os.path.isdir(path) and not any(
            glob.glob(os.path.join(path, pattern)) for pattern in WEIGHT_FILES
        ):
            raise ConfigError(f"{key}: {path} has no model weights (*.safetensors or "
                              "pytorch_model*.bin)")


def model_families(cfg: RollflowConfig) -> list[tuple[str, str, str]]:
    """(backend, config key, local model directory) of each model a backend rollflow runs
    will load; SGLang servers, mock backends and remote paths are not checked here (the
    backend checks what it loads when it is built)."""
    found: list[tuple[str, str, str | None]] = []
    if cfg.train.backend != "mock":
        key = "train.model_path" if cfg.train.model_path else "train.load"
        found.append((cfg.train.backend, key, cfg.train.model_path or cfg.train.load))
    if cfg.engine.backend == "embedded":
        found.append(("embedded", "engine.model_path", cfg.engine.model_path))
    return [(b, k, p) for b, k, p in found if p and os.path.isfile(os.path.join(p, "config.json"))]


def check_model_families(cfg: RollflowConfig) -> None:
    """Each model is of a family its backend runs (`engines.weights.model_families`): a
    model of another family would load, then fail or train on wrong numbers inside an
    actor."""
    errors = []
    for backend, key, path in model_families(cfg):
        with open(os.path.join(path, "config.json")) as f:
            model_type = json.load(f).get("model_type")
        try:
            check_model_family(model_type, backend, f"{key} ({path})")
        except UnsupportedModelError as e:
            errors.append(str(e))
    if errors:
        raise ConfigError("\n".join(errors))


CREDENTIALS_FIX = (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in this shell, or "
    "storage.storage_options={key: ..., secret: ...}, or storage.credentials_block=NAME (a "
    "Prefect Secret block); docs/security.md, \"Object storage\"")


def _lacks_credentials(exc: BaseException) -> bool:
    """botocore found no credentials, whether raised as is or inside a StorageError."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ == "NoCredentialsError" or "NoCredentialsError" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


@contextmanager
def credentials_named(key: str, uri: str) -> Iterator[None]:
    """An S3 request made without credentials fails as a config error (exit code 2) naming
    the URI, the config key and what to set, not as botocore's bare `NoCredentialsError`."""
    try:
        yield
    except Exception as e:
        if _lacks_credentials(e):
            raise ConfigError(f"{key}: no S3 credentials to read or write {uri}: "
                              f"{CREDENTIALS_FIX}") from None
        raise


def check_storage(cfg: RollflowConfig) -> RunLayout:
    """The run directory exists (or can be made) and takes a write."""
    s = cfg.storage
    try:
        with credentials_named("storage.uri", s.uri):
            layout = RunLayout.open(s.uri, s.run_name, s.endpoint_url, s.store_options())
            layout.store.write_text("ok", ".preflight")
            layout.store.delete(".preflight")
    except OSError as e:
        raise ConfigError(f"storage.uri: cannot write the run directory under {s.uri!r}: "
                          f"{e}") from None
    return layout


def check_rewards(cfg: RollflowConfig, hub: RewardHub, fields: FieldReport) -> None:
    """Every training row has a reward function: the run's, or its metadata.rm_type (an
    agent, `rollout.agent_path`, or an environment's episode may return the reward itself)."""
    r = cfg.rollout
    if r.function_path or r.agent_path or r.environment or r.debug_train_only or hub.configured:
        return
    if fields.without_rm_type is not None:
        raise ConfigError(
            "rollout.rm_type: no reward function (set rollout.rm_type or "
            f"rollout.custom_rm_path); {fields.without_rm_type} has no metadata.rm_type either"
        )
    for rm_type, where in fields.rm_types.items():  # an unknown one fails, naming its row
        builtin_reward(rm_type, f"{where}, metadata.rm_type", hub.remote, judge=hub.judge)


def label_readers(rm_type: str | None, custom: bool, fields: FieldReport) -> list[str]:
    """The rewards of a prompt set that compare responses with its label: the set's default
    rule (unless every row names its own) and the rules rows name in metadata.rm_type."""
    readers = []
    if rm_type and not custom and fields.without_rm_type is not None and compares_with_label(
            rm_type):
        readers.append(f"rm_type {rm_type!r}")
    readers += [f"metadata.rm_type {name!r} ({where})"
                for name, where in fields.rm_types.items() if compares_with_label(name)]
    return readers


def check_labels(spec: DatasetSpec, readers: list[str], fields: FieldReport) -> None:
    """A reward that compares with the label, on a set with no label, scores every response
    0: the run would train on nothing, silently. Fail naming the file and the key."""
    if not readers or not fields.rows or fields.labelled == fields.rows:
        return
    key, uses = f"{spec.config_key}.label_key", " and ".join(readers)
    have = f"its rows have: {', '.join(fields.fields)}" if fields.fields else "no fields"
    if fields.labelled == 0:
        problem = (f"{key} is unset" if spec.label_key is None else
                   f"no row has the label field {spec.label_key!r} ({key})")
        raise DatasetError(spec.path, 0, "(file)",
                           f"{problem}, but the reward ({uses}) compares each response with "
                           f"the label, so every reward would be 0; set {key} to the field "
                           f"that holds the answers ({have})")
    log.warning("%s: %d of %d rows have no label %r; the reward (%s) scores them 0",
                spec.path, fields.rows - fields.labelled, fields.rows, spec.label_key, uses)


def check_eval_reward(ds: EvalDataset, index: int, hub: RewardHub) -> None:
    key = f"eval.datasets[{index}]"
    if ds.custom_rm_path:
        load_hook(ds.custom_rm_path, f"{key}.custom_rm_path", RewardFn)
    elif ds.rm_type:
        builtin_reward(ds.rm_type, f"{key}.rm_type", hub.remote)
    elif not hub.configured and not is_environment_uri(ds.path):  # (episodes score themselves)
        raise ConfigError(f"{key}.rm_type: no reward function for eval set {ds.name!r} (set "
                          "it, or rollout.rm_type / rollout.custom_rm_path)")


def check_heldout(cfg: RollflowConfig) -> None:
    """A reasoning_gym:// eval set is held out only if its generator's random streams miss
    the training set's: one that repeats training entries is refused, naming its key; one
    that shares streams under other settings, or questions a small problem space repeats
    across seeds, is warned of with the count."""
    train = cfg.data.prompt_data
    if not is_task_uri(train):
        return
    for i, ds in enumerate(cfg.eval.datasets):
        if not is_task_uri(ds.path):
            continue
        issue = heldout_issue(train, ds.path)
        if issue is not None and issue.same_entries:
            raise ConfigError(f"eval.datasets[{i}].path: {ds.path} is not held out: "
                              f"{issue.message}")
        if issue is not None:
            log.warning("eval.datasets[%d] (%s): %s", i, ds.path, issue.message)
        shared, total = shared_questions(train, ds.path)
        if shared:
            log.warning("eval.datasets[%d] (%s): %d of its %d questions also occur in the "
                        "training set (the task's problem space is small enough that seeds "
                        "repeat questions)", i, ds.path, shared, total)


def preflight(cfg: RollflowConfig) -> PreflightReport:
    """Check the run before any actor starts; returns what was found. The config is not
    changed: the actors derive the same defaults (the prompt limit) themselves, so the
    config, and the digest naming the run's actors, stay what the user wrote."""
    start = time.perf_counter()
    if not cfg.engine.urls:  # engines rollflow starts bind engine.host
        warn_if_public("engine.host", cfg.engine.host)
    check_files_exist(cfg)
    check_model_weights(cfg)
    check_model_families(cfg)
    check_storage(cfg)
    validate_hooks(cfg)
    hub = RewardHub.from_config(cfg.rollout)
    tokenizer, context = load_tokenizer_and_context(cfg)
    limit = checked_prompt_limit(cfg, context)
    with credentials_named("data.prompt_data", str(cfg.data.prompt_data)):
        train_set = data_spec(cfg.data, cfg.storage, limit)
        checked = _check(cfg, train_set, tokenizer)  # logs drops
    check_rewards(cfg, hub, checked.fields)
    if not (cfg.rollout.function_path or cfg.rollout.debug_train_only):
        r = cfg.rollout
        check_labels(train_set, label_readers(r.rm_type, bool(r.custom_rm_path), checked.fields),
                     checked.fields)
    groups_needed = cfg.rollout.submit_batch_size
    generation_loop = not (cfg.rollout.debug_train_only or cfg.rollout.function_path)
    if generation_loop and checked.usable < groups_needed:
        log.warning("%s: %d usable prompts, fewer than the %d groups a step draws; prompts "
                    "repeat within a step", cfg.data.prompt_data, checked.usable, groups_needed)
    eval_prompts, labels = {}, []
    for i, ds in enumerate(cfg.eval.datasets):
        check_eval_reward(ds, i, hub)
        with credentials_named(f"eval.datasets[{i}].path", str(ds.path)):
            spec = eval_spec(ds, i, limit, cfg.storage)
            evals = _check(cfg, spec, tokenizer)
        if evals.dropped_too_long:
            log.warning("eval.datasets[%d] (%s): %d prompts longer than %d tokens will get no "
                        "room to answer", i, ds.path, evals.dropped_too_long, limit)
        eval_prompts[ds.name] = evals.rows
        rm_type, custom = ((ds.rm_type, bool(ds.custom_rm_path)) if ds.custom_rm_path or ds.rm_type
                           else (cfg.rollout.rm_type, bool(cfg.rollout.custom_rm_path)))
        labels.append((spec, label_readers(rm_type, custom, evals.fields), evals.fields))
    for spec, readers, fields in labels:  # after every set's own checks
        check_labels(spec, readers, fields)
    check_heldout(cfg)
    return PreflightReport(checked.usable, checked.dropped_too_long, limit, eval_prompts,
                           time.perf_counter() - start)


_last_passed: dict[str, PreflightReport] = {}


def _fingerprint(cfg: RollflowConfig) -> str:
    """The config (secrets included) and the size and mtime of every input it names."""
    files = {k: (os.path.getsize(p), os.path.getmtime(p)) if os.path.isfile(p) else None
             for k, p in input_files(cfg).items()}
    dumped = cfg.model_dump(mode="json")
    return json.dumps([dumped, cfg.storage.storage_options, files], sort_keys=True, default=str)


def preflight_once(cfg: RollflowConfig) -> PreflightReport:
    """`preflight`, skipped when this process already checked the same config and inputs:
    the CLI checks before starting Prefect (a mistake then fails before a Prefect server has
    started), and the train flow, which deployments start
    without the CLI, checks again."""
    key = _fingerprint(cfg)
    if key not in _last_passed:
        report = preflight(cfg)
        _last_passed.clear()
        _last_passed[key] = report
    return _last_passed[key]
