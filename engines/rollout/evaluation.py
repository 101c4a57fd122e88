"""Held-out evaluation through the same engines and reward functions as training."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engines.prompt_dataset import DatasetSpec, load_prompt_samples
from engines.rollout.generation import EngineClient, GenerationLoop
from flows.config import EvalDataset, RolloutConfig
from storage.sample import Group, Status
from tasks.rm_hub import RewardFn


def eval_groups(ds: EvalDataset, tokenizer: Any) -> list[Group]:
    spec = DatasetSpec(path=ds.path, input_key=ds.input_key, label_key=ds.label_key)
    prompts = load_prompt_samples(spec, tokenizer)[: ds.max_prompts]
    groups: list[Group] = []
    index = 0
    for gi, p in enumerate(prompts):
        group = []
        for _ in range(ds.n_samples_per_eval_prompt):
            s = p.clone()
            s.index, s.group_index = index, gi
            index += 1
            group.append(s)
        groups.append(group)
    return groups


async def evaluate_datasets(
    datasets: Sequence[EvalDataset],
    clients: Sequence[EngineClient],
    tokenizer: Any,
    rollout_cfg: RolloutConfig,
    reward_fn: RewardFn | None,
    hook_args: Any,
) -> dict[str, float]:
    """`eval/{name}` (mean reward, i.e. accuracy for 0/1 rewards) and its truncated ratio."""
    metrics: dict[str, float] = {}
    for ds in datasets:
        cfg = rollout_cfg.model_copy(
            update={
                "temperature": ds.temperature,
                "max_response_len": ds.max_response_len or rollout_cfg.max_response_len,
            }
        )
        loop = GenerationLoop(cfg, clients, reward_fn, hook_args)
        groups, stats = await loop.run(eval_groups(ds, tokenizer))
        samples = [s for g in groups for s in g]
        rewards = [s.scalar_reward(rollout_cfg.reward_key) for s in samples]
        metrics[f"eval/{ds.name}"] = sum(rewards) / max(len(rewards), 1)
        metrics[f"eval/{ds.name}/truncated_ratio"] = sum(
            s.status == Status.TRUNCATED for s in samples
        ) / max(len(samples), 1)
        metrics[f"eval/{ds.name}/samples"] = float(len(samples))
        metrics[f"eval/{ds.name}/seconds"] = stats.seconds
    return metrics
