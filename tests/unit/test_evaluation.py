"""Evaluation on several named datasets, each with its own sampling params, reward and
samples per prompt, through a real embedded engine on the tiny model."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from engines.inference.engine_actor import EngineActor
from engines.rollout.evaluation import eval_reward_fn, eval_rollout_config, evaluate_datasets
from engines.rollout.rewards import RewardHub
from engines.rollout.sglang_client import SGLangClient
from flows.config.run import EngineConfig, EvalDataset, RolloutConfig
from storage.sample import Sample


async def response_length(args: Any, sample: Sample) -> float:
    return float(sample.response_length)


def test_eval_config_overrides_only_what_the_dataset_sets() -> None:
    base = RolloutConfig(num_rollout=1, rollout_batch_size=1, top_p=0.9, top_k=5, stop=["x"])
    ds = EvalDataset(name="a", path="p", temperature=0.6, top_k=20, n_samples_per_eval_prompt=4)
    cfg = eval_rollout_config(ds, base)
    assert (cfg.temperature, cfg.top_p, cfg.top_k, cfg.stop) == (0.6, 0.9, 20, ["x"])
    assert cfg.n_samples_per_prompt == 4 and cfg.max_response_len == base.max_response_len


def test_a_datasets_own_reward_is_built_with_the_rollout_sections_settings() -> None:
    """An eval set naming remote_rm or a judge gets the run's rm_url / judge section, as the
    run's own reward does (before: `remote_rm needs rollout.rm_url` at the first eval)."""
    rollout = RolloutConfig(num_rollout=1, rollout_batch_size=1, rm_type="exact_match",
                            rm_url="http://127.0.0.1:9/score")
    ds = EvalDataset(name="held", path="x.jsonl", rm_type="remote_rm")
    hub = eval_reward_fn(ds, None, rollout)
    assert isinstance(hub, RewardHub) and hub.remote is not None
    assert hub.remote.url == "http://127.0.0.1:9/score"
    assert eval_reward_fn(EvalDataset(name="held", path="x.jsonl"), None, rollout) is None


def test_two_named_datasets_with_their_own_params(tmp_path: Path, tiny_model_dir: str) -> None:
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "label": str(2 * i)}) + "\n" for i in range(5)))
    hook = f"{__name__}:response_length"
    datasets = [
        EvalDataset(name="short", path=str(data), max_response_len=3, custom_rm_path=hook,
                    max_prompts=4),
        EvalDataset(name="greedy3", path=str(data), n_samples_per_eval_prompt=3,
                    max_response_len=5, rm_type="exact_match"),
    ]
    rollout = RolloutConfig(num_rollout=1, rollout_batch_size=1, max_response_len=64)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    threads = torch.get_num_threads()
    actor = EngineActor(EngineConfig(backend="embedded", model_path=tiny_model_dir), 0, num_threads=1)
    try:
        async def main() -> dict[str, float]:
            async with SGLangClient(actor.url()) as client:
                return await evaluate_datasets(datasets, [client], tokenizer, rollout, None, None)

        m = asyncio.run(main())
    finally:
        actor.shutdown()
        torch.set_num_threads(threads)
    # the untrained model never stops early: every response hits its dataset's own limit
    assert m["eval/short/samples"] == 4.0 and m["eval/short"] == 3.0
    assert m["eval/short/truncated_ratio"] == 1.0 and m["eval/short/response_len_mean"] == 3.0
    assert m["eval/greedy3/samples"] == 15.0 and m["eval/greedy3/response_len_mean"] <= 5.0
    assert m["eval/greedy3"] == 0.0 and m["eval/greedy3/pass@3"] == 0.0
    assert "eval/short/pass@1" not in m
