"""The generation loop: groups of prompts -> engines over HTTP -> rewarded groups.

```
 groups ──► semaphore (concurrency x engines) ──► SGLang /generate (round-robin engine)
                                                          │  one batched request per group
   rewards (async rm) ◄── group finished ◄────────────────┘
        │
        ▼
   finished groups (sorted by index)
```
Each sample carries `sampling_seed = rollout.seed + sample.index`, so a sample's response
depends only on its index and the weights, never on batch composition; that is what makes a
resumed run regenerate exactly what an uninterrupted run would have.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flows.config import RolloutConfig
from storage.sample import Group, Sample, Status
from tasks.rm_hub import RewardFn, compute_reward

FINISH_TO_STATUS = {
    "stop": Status.COMPLETED,
    "length": Status.TRUNCATED,
    "abort": Status.ABORTED,
}


class GenerateOutputLike(Protocol):
    @property
    def output_ids(self) -> list[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def log_probs(self) -> list[float]: ...
    @property
    def finish_reason(self) -> dict[str, Any]: ...
    @property
    def weight_version(self) -> int: ...


class EngineClient(Protocol):
    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        rids: list[str] | None = None,
        return_logprob: bool = True,
    ) -> Sequence[GenerateOutputLike]: ...


@dataclass
class GenerationStats:
    groups: int = 0
    samples: int = 0
    generated_tokens: int = 0
    truncated: int = 0
    aborted: int = 0
    seconds: float = 0.0
    response_lengths: list[int] = field(default_factory=list)

    def as_metrics(self) -> dict[str, float]:
        n = max(self.samples, 1)
        lengths = self.response_lengths or [0]
        return {
            "rollout/groups": float(self.groups),
            "rollout/samples": float(self.samples),
            "rollout/generated_tokens": float(self.generated_tokens),
            "rollout/tokens_per_s": self.generated_tokens / max(self.seconds, 1e-9),
            "rollout/truncated_ratio": self.truncated / n,
            "rollout/aborted": float(self.aborted),
            "rollout/response_len_mean": sum(lengths) / len(lengths),
            "rollout/response_len_max": float(max(lengths)),
            "rollout/seconds": self.seconds,
        }


def sampling_params_for(cfg: RolloutConfig, sample: Sample) -> dict[str, Any]:
    """SGLang sampling params; a partial sample continues with the budget it has left."""
    return {
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "max_new_tokens": cfg.max_response_len - sample.response_length,
        "stop": list(cfg.stop),
        "stop_token_ids": list(cfg.stop_token_ids),
        "skip_special_tokens": True,
        "no_stop_trim": False,
        "sampling_seed": cfg.seed + sample.index,
    }


def apply_output(sample: Sample, out: GenerateOutputLike) -> None:
    sample.append_response(list(out.output_ids), list(out.log_probs), out.text)
    sample.status = FINISH_TO_STATUS.get(out.finish_reason.get("type", ""), Status.FAILED)
    sample.weight_version = out.weight_version


class GenerationLoop:
    """Runs groups through a set of engine clients and scores each finished group."""

    def __init__(
        self,
        cfg: RolloutConfig,
        clients: Sequence[EngineClient],
        reward_fn: RewardFn | None,
        hook_args: Any = None,
    ) -> None:
        if not clients:
            raise ValueError("the generation loop needs at least one engine")
        self.cfg = cfg
        self.clients = list(clients)
        self.reward_fn = reward_fn
        self.hook_args = hook_args
        self._next_client = itertools.cycle(self.clients)
        self._semaphore = asyncio.Semaphore(cfg.concurrency * len(self.clients))

    async def generate_group(self, group: Group) -> Group:
        """One batched /generate call per group: the group shares a prompt, so it stays on
        one engine (prefix cache) and costs one HTTP round trip instead of n."""
        todo = [s for s in group if s.status not in (Status.COMPLETED, Status.TRUNCATED)]
        params = [sampling_params_for(self.cfg, s) for s in todo]
        for s, p in zip(todo, params, strict=True):
            if p["max_new_tokens"] <= 0:
                s.status = Status.TRUNCATED
        live = [(s, p) for s, p in zip(todo, params, strict=True) if p["max_new_tokens"] > 0]
        if live:
            client = next(self._next_client)
            async with self._semaphore:
                outs = await client.generate_batch(
                    [s.tokens for s, _ in live],
                    [p for _, p in live],
                    rids=[f"sample-{s.index}" for s, _ in live],
                )
            for (s, _), out in zip(live, outs, strict=True):
                apply_output(s, out)
        if self.reward_fn is not None or any("rm_type" in s.metadata for s in group):
            rewards = await asyncio.gather(
                *(compute_reward(self.hook_args, s, self.reward_fn) for s in group)
            )
            for s, r in zip(group, rewards, strict=True):
                s.reward = r
        return group

    async def run(self, groups: list[Group]) -> tuple[list[Group], GenerationStats]:
        start = time.perf_counter()
        done = await asyncio.gather(*(self.generate_group(g) for g in groups))
        stats = GenerationStats(seconds=time.perf_counter() - start)
        for g in done:
            stats.groups += 1
            for s in g:
                stats.samples += 1
                stats.generated_tokens += s.response_length
                stats.response_lengths.append(s.response_length)
                stats.truncated += s.status == Status.TRUNCATED
                stats.aborted += s.status == Status.ABORTED
        done.sort(key=lambda g: g[0].index)
        return done, stats
