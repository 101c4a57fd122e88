"""Held-out evaluation through the same engines and reward functions as training.

Each named dataset has its own sampling params, reward and `n_samples_per_eval_prompt`
(fields left unset fall back to the rollout section), and is reported as
`eval/{name}` (mean reward: accuracy for 0/1 rewards), `eval/{name}/truncated_ratio`, and
with several samples per prompt `eval/{name}/pass@{n}` (share of prompts with any sample
rewarded > 0). A custom `eval.eval_function_path` (`protocols.EvalFn`) adds its own metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engines.config.rollout import EvalDataset, RolloutConfig
from engines.data.prompt_dataset import DatasetSpec, load_prompt_samples
from engines.hooks.loader import bad_return
from engines.hooks.protocols import EvalFn, GenerateFn, RewardFn
from engines.rollout.dispatch import EngineClient
from engines.rollout.generation import build_generation_loop
from engines.rollout.rewards.hub import RewardHub
from storage.config import StorageConfig
from storage.sample import Group, Status


def eval_spec(ds: EvalDataset, index: int, max_prompt_len: int | None = None,
              storage: StorageConfig | None = None) -> DatasetSpec:
    """How eval set `index` is read (s3:// paths through `storage`); its errors name
    `eval.datasets[index].*` keys. Row keys left unset were filled from the data section
    when the config was validated."""
    return DatasetSpec(
        path=ds.path,
        input_key=ds.input_key or "prompt",
        label_key=ds.label_key,
        metadata_key=ds.metadata_key,
        apply_chat_template=bool(ds.apply_chat_template),
        max_prompt_len=max_prompt_len,
        config_key=f"eval.datasets[{index}]",
        split=ds.split,
        endpoint_url=storage.endpoint_url if storage else None,
        storage_options=storage.options_for(ds.path) if storage else {},
    )


def eval_groups(ds: EvalDataset, tokenizer: Any, index: int = 0,
                storage: StorageConfig | None = None) -> list[Group]:
    """The set's first `max_prompts` prompts (only those rows are read), as groups."""
    spec = eval_spec(ds, index, storage=storage)
    prompts = load_prompt_samples(spec, tokenizer, limit=ds.max_prompts).samples
    groups: list[Group] = []
    index = 0
    for gi, p in enumerate(prompts):
        group = []
        for _ in range(ds.n_samples_per_eval_prompt):
            s = p.clone()
            s.index, s.group_index = index, gi
            s.metadata["eval_dataset"] = ds.name
            index += 1
            group.append(s)
        groups.append(group)
    return groups


def eval_rollout_config(ds: EvalDataset, rollout_cfg: RolloutConfig) -> RolloutConfig:
    """The rollout section with this dataset's sampling params laid over it."""
    overrides: dict[str, Any] = {
        "temperature": ds.temperature,
        "top_p": ds.top_p,
        "top_k": ds.top_k,
        "max_response_len": ds.max_response_len,
        "stop": ds.stop,
        "stop_token_ids": ds.stop_token_ids,
        "n_samples_per_prompt": ds.n_samples_per_eval_prompt,
    }
    return rollout_cfg.model_copy(update={k: v for k, v in overrides.items() if v is not None})


def eval_reward_fn(
    ds: EvalDataset, default: RewardHub | RewardFn | None, rollout_cfg: RolloutConfig
) -> RewardHub | RewardFn | None:
    """The dataset's own reward, built as the run's is (the rollout section's remote model,
    judge and sandbox settings), or the run's."""
    if ds.custom_rm_path or ds.rm_type:
        return RewardHub.from_config(rollout_cfg.model_copy(update={
            "rm_type": ds.rm_type, "custom_rm_path": ds.custom_rm_path, "group_rm": False}))
    return default


def dataset_metrics(name: str, groups: list[Group], reward_key: str | None) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    n = max(len(samples), 1)
    metrics = {
        f"eval/{name}": sum(s.scalar_reward(reward_key) for s in samples) / n,
        f"eval/{name}/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / n,
        f"eval/{name}/samples": float(len(samples)),
        f"eval/{name}/response_len_mean": sum(s.response_length for s in samples) / n,
    }
    k = len(groups[0]) if groups else 1
    if k > 1:
        solved = sum(any(s.scalar_reward(reward_key) > 0 for s in g) for g in groups)
        metrics[f"eval/{name}/pass@{k}"] = solved / max(len(groups), 1)
    return metrics


async def evaluate_datasets(
    datasets: Sequence[EvalDataset],
    clients: Sequence[EngineClient],
    tokenizer: Any,
    rollout_cfg: RolloutConfig,
    reward_fn: RewardHub | RewardFn | None,
    hook_args: Any,
    storage: StorageConfig | None = None,
    generate_for: Callable[[EvalDataset], GenerateFn | None] = lambda ds: None,
) -> dict[str, float]:
    """Each held-out set generated and scored; `generate_for(ds)` replaces the HTTP call per
    sample where a set needs it (an environment's episodes through the agent gateway)."""
    metrics: dict[str, float] = {}
    for index, ds in enumerate(datasets):
        rewards = eval_reward_fn(ds, reward_fn, rollout_cfg)
        loop = build_generation_loop(eval_rollout_config(ds, rollout_cfg), clients, rewards,
                                     hook_args, custom_generate=generate_for(ds))
        groups, stats = await loop.run(eval_groups(ds, tokenizer, index, storage))
        metrics.update(dataset_metrics(ds.name, groups, rollout_cfg.reward_key))
        metrics[f"eval/{ds.name}/seconds"] = stats.seconds
    return metrics


async def custom_eval_metrics(fn: EvalFn, args: Any, weight_version: int) -> dict[str, float]:
    """The custom eval function's metrics, named `eval/...` like the built-in ones; a
    result that is not a mapping of numbers fails here as a `HookError` naming the hook and
    the key (not later in a metric sink, and not retried: it would return the same)."""
    key = "eval.eval_function_path"
    result = await fn(args, weight_version)
    if not isinstance(result, Mapping):
        raise bad_return(fn, key, result, "a mapping of metric name -> number")
    metrics: dict[str, float] = {}
    for name, value in result.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_return(fn, key, value, "a number", part=f"for metric {name!r}")
        metrics[name if str(name).startswith("eval/") else f"eval/{name}"] = float(value)
    return metrics
