"""The rollout side of a run, as one long-lived actor: data source, generation, filter, reward.

Every method reads its input from and writes its output to the run directory and returns a
small dict, so the Prefect tasks that call it stay thin, and any method can be re-run after a
crash from what is on storage. The data source is reloaded from the previous step's saved
state before drawing, so the in-memory state never has to survive a restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engines.data_source import RolloutDataSourceWithBuffer, groups_in_order, pop_first
from engines.hooks import load_hook
from engines.prompt_dataset import DatasetSpec, load_prompt_samples
from engines.rollout.evaluation import evaluate_datasets
from engines.rollout.generation import GenerationLoop
from engines.rollout.sglang_client import SGLangClient
from flows.config import RollflowConfig
from storage.batch_io import read_samples, write_samples
from storage.run_layout import RunLayout, step_dir
from storage.sample import Group, Status, flatten
from tasks.rm_hub import resolve_reward_fn

RolloutFn = Callable[[Any, int, Any, bool], list[Group]]


class StepDataSource:
    """What a rollout function sees as `data_source` during one step: the groups drawn by
    sample_prompts first, then further draws from the real source (dynamic sampling)."""

    def __init__(self, drawn: list[Group], source: RolloutDataSourceWithBuffer, rollout_id: int):
        self._drawn = list(drawn)
        self._source = source
        self._rollout_id = rollout_id
        self.extra_draws = 0

    def get_samples(self, num_groups: int) -> list[Group]:
        taken, self._drawn = self._drawn[:num_groups], self._drawn[num_groups:]
        missing = num_groups - len(taken)
        if missing > 0:
            self.extra_draws += missing
            taken.extend(self._source.get_samples(missing, self._rollout_id))
        return taken

    def add_samples(self, groups: list[Group]) -> None:
        self._source.add_samples(groups)


def tokenizer_path(cfg: RollflowConfig) -> str | None:
    return cfg.engine.model_path or cfg.train.model_path or cfg.train.load


class RolloutManager:
    def __init__(self, cfg: RollflowConfig) -> None:
        self.cfg = cfg
        self.layout = RunLayout.open(
            cfg.storage.uri,
            cfg.storage.run_name,
            cfg.storage.endpoint_url,
            cfg.storage.storage_options,
        )
        self.tokenizer = self._load_tokenizer()
        spec = DatasetSpec(
            path=cfg.data.prompt_data,
            input_key=cfg.data.input_key,
            label_key=cfg.data.label_key,
            metadata_key=cfg.data.metadata_key,
            apply_chat_template=cfg.data.apply_chat_template,
            max_prompt_len=cfg.data.rollout_max_prompt_len,
        )
        buffer_filter = (
            load_hook(cfg.rollout.buffer_filter_path, "rollout.buffer_filter_path", 4)
            if cfg.rollout.buffer_filter_path
            else pop_first
        )
        self.data_source = RolloutDataSourceWithBuffer(
            load_prompt_samples(spec, self.tokenizer),
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
            seed=cfg.data.seed,
            shuffle=cfg.data.shuffle,
            buffer_filter=buffer_filter,
            hook_args=cfg,
        )
        self.rollout_fn: RolloutFn | None = (
            load_hook(cfg.rollout.function_path, "rollout.function_path", 4)
            if cfg.rollout.function_path
            else None
        )
        self.reward_fn = resolve_reward_fn(cfg.rollout.rm_type, cfg.rollout.custom_rm_path)
        self.engine_urls: list[str] = []

    def _load_tokenizer(self) -> Any:
        path = tokenizer_path(self.cfg)
        if path is None:
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)

    def set_engines(self, urls: list[str]) -> None:
        self.engine_urls = list(urls)

    def _compression(self) -> str | None:
        return self.cfg.storage.compression

    def _restore_source(self, rollout_id: int) -> None:
        """Data source as committed by the previous step (or fresh at step 0)."""
        if rollout_id == 0:
            self.data_source.reset()
        else:
            self.data_source.load(self.layout, rollout_id - 1)

    # -- step stages ---------------------------------------------------------------------
    def sample_prompts(self, rollout_id: int) -> dict[str, Any]:
        self._restore_source(rollout_id)
        groups = self.data_source.get_samples(self.cfg.rollout.submit_batch_size, rollout_id)
        uri = write_samples(
            self.layout.store,
            flatten(groups),
            step_dir(rollout_id),
            "prompts.arrow",
            compression=self._compression(),
        )
        self.data_source.save(self.layout, rollout_id, self._compression())
        return {"uri": uri, "groups": len(groups), "epoch": self.data_source.state.epoch_id}

    def generate(self, rollout_id: int) -> dict[str, Any]:
        self.data_source.load(self.layout, rollout_id)
        drawn = groups_in_order(
            read_samples(self.layout.store, step_dir(rollout_id), "prompts.arrow")
        )
        step_source = StepDataSource(drawn, self.data_source, rollout_id)
        metrics: dict[str, Any] = {}
        if self.rollout_fn is not None:
            groups = self.rollout_fn(self.cfg, rollout_id, step_source, False)
        else:
            groups, stats = asyncio.run(
                run_generation(self.cfg, self.engine_urls, self.reward_fn, step_source)
            )
            metrics.update(stats.as_metrics())
        uri = write_samples(
            self.layout.store,
            flatten(groups),
            step_dir(rollout_id),
            "rollout.arrow",
            compression=self._compression(),
        )
        self.data_source.save(self.layout, rollout_id, self._compression())
        return {"uri": uri, "groups": len(groups), **metrics}

    def filter(self, rollout_id: int) -> dict[str, Any]:
        """Keep whole groups that finished; aborted groups wait in the buffer; trim to
        rollout_batch_size (the surplus returns to the buffer, whole)."""
        groups = groups_in_order(
            read_samples(self.layout.store, step_dir(rollout_id), "rollout.arrow")
        )
        finished = [g for g in groups if all(s.status != Status.ABORTED for s in g)]
        failed = [g for g in finished if any(s.status == Status.FAILED for s in g)]
        finished = [g for g in finished if g not in failed]
        aborted = [g for g in groups if any(s.status == Status.ABORTED for s in g)]
        kept = finished[: self.cfg.rollout.rollout_batch_size]
        surplus = finished[self.cfg.rollout.rollout_batch_size :]
        if aborted or surplus:
            self.data_source.load(self.layout, rollout_id)
            self.data_source.add_samples(aborted + surplus)
            self.data_source.save(self.layout, rollout_id, self._compression())
        return {
            "kept_groups": [g[0].group_index for g in kept],
            "filter/kept": len(kept),
            "filter/failed": len(failed),
            "filter/returned_to_buffer": len(aborted) + len(surplus),
        }

    def reward(self, rollout_id: int, kept_groups: list[int]) -> dict[str, Any]:
        """Final scalar rewards for training; a dict reward is kept in metadata."""
        samples = read_samples(self.layout.store, step_dir(rollout_id), "rollout.arrow")
        keep = set(kept_groups)
        train = sorted((s for s in samples if s.group_index in keep), key=lambda s: s.index)
        rewards = []
        for s in train:
            if isinstance(s.reward, dict):
                s.metadata["reward_dict"] = s.reward
            s.reward = s.scalar_reward(self.cfg.rollout.reward_key)
            rewards.append(s.reward)
        uri = write_samples(
            self.layout.store,
            train,
            step_dir(rollout_id),
            "train.arrow",
            compression=self._compression(),
        )
        n = max(len(rewards), 1)
        mean = sum(rewards) / n
        return {
            "uri": uri,
            "samples": len(train),
            "reward/mean": mean,
            "reward/std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        }

    def evaluate(self, weight_version: int) -> dict[str, float]:
        metrics = asyncio.run(
            run_evaluation(self.cfg, self.engine_urls, self.tokenizer, self.reward_fn)
        )
        self.layout.save_eval(weight_version, metrics)
        return metrics


# Module-level on purpose: an `async def` method would turn the Ray actor into an async actor.
async def run_generation(
    cfg: RollflowConfig, urls: list[str], reward_fn: Any, source: StepDataSource
) -> tuple[list[Group], Any]:
    clients = [SGLangClient(url) for url in urls]
    try:
        loop = GenerationLoop(cfg.rollout, clients, reward_fn, hook_args=cfg)
        return await loop.run(source.get_samples(cfg.rollout.submit_batch_size))
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))


async def run_evaluation(
    cfg: RollflowConfig, urls: list[str], tokenizer: Any, reward_fn: Any
) -> dict[str, float]:
    clients = [SGLangClient(url) for url in urls]
    try:
        return await evaluate_datasets(
            cfg.eval.datasets, clients, tokenizer, cfg.rollout, reward_fn, cfg
        )
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
