"""Where the rollout actor's generation runs: one step's dynamic-sampling generation
(`run_generation`), the session a generation loop runs in (`generation_session`: engine
clients, router, engine watch, agent gateway; async mode's loop keeps one across steps),
and the held-out evaluation (`run_evaluation`). Module-level async functions on purpose: an
`async def` method would turn the Ray actor (engines/rollout/rollout_manager.py) into an
async actor.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from engines.config.rollout import EvalDataset, is_environment_uri
from engines.config.run import RunConfig
from engines.environments.rows import environment_agent
from engines.hooks.protocols import AgentFn, EvalFn, GenerateFn
from engines.rollout.agent_gateway import AgentGateway
from engines.rollout.dispatch import Dispatch, RouterDispatch
from engines.rollout.engine_watch import EngineWatch
from engines.rollout.evaluation import custom_eval_metrics, evaluate_datasets
from engines.rollout.filters import DynamicFilter
from engines.rollout.generation import (
    GenerationLoop,
    HookArgs,
    RolloutResult,
    build_generation_loop,
)
from engines.rollout.restore import GroupSource, Restored, StepLog
from engines.rollout.rewards.hub import RewardHub
from engines.rollout.sglang_client import SGLangClient


@dataclass(frozen=True)
class LoopHooks:
    """The user/built-in functions the generation loop calls, resolved once at startup."""

    rewards: RewardHub
    dynamic_filter: DynamicFilter | None
    custom_generate: GenerateFn | None
    agent: AgentFn | None = None


async def run_generation(
    cfg: RunConfig,
    urls: list[str],
    router_url: str | None,
    hooks: LoopHooks,
    source: GroupSource,
    target: int,
    tokenizer: Any = None,
    progress: Callable[[int, int], None] | None = None,
    min_weight_version: int | None = None,
    journal: StepLog | None = None,
    restored: Restored | None = None,
    router_workers: Callable[[list[str]], None] | None = None,
) -> RolloutResult:
    """One step's dynamic-sampling generation through the router (or the engines directly).
    `router_workers(urls)` sets the router's worker set (a lost engine leaves it)."""
    async with generation_session(
        cfg, urls, router_url, hooks, tokenizer, target=target, progress=progress,
        min_weight_version=min_weight_version, router_workers=router_workers,
    ) as loop:
        return await loop.run_dynamic(source, journal, restored)


@asynccontextmanager
async def generation_session(
    cfg: RunConfig,
    urls: list[str],
    router_url: str | None,
    hooks: LoopHooks,
    tokenizer: Any = None,
    *,
    target: int | None,
    progress: Callable[[int, int], None] | None = None,
    min_weight_version: int | None = None,
    router_workers: Callable[[list[str]], None] | None = None,
) -> AsyncIterator[GenerationLoop]:
    """A generation loop over clients of `urls` (and the router), with its engine watch and
    agent gateway, all closed on exit: one step's (`run_generation`) or async mode's, which
    lives across steps (engines/rollout/async_producer.py)."""
    replay = cfg.algorithm.routing_replay  # the trainer replays the engines' MoE routing
    engines = [SGLangClient(url, return_routed_experts=replay) for url in urls]
    router = SGLangClient(router_url, return_routed_experts=replay) if router_url else None
    r = cfg.rollout
    watch = EngineWatch(list(urls), r.engine_health_interval_s, r.engine_hang_timeout_s,
                        on_lost=lambda url, why: loop.lose_engine(url, why)) \
        if urls and r.engine_health_interval_s > 0 else None

    async def remove_worker(url: str) -> None:
        if router_workers is not None and watch is not None:
            await asyncio.to_thread(router_workers, watch.live())

    # Straight to the engines: the loop decides how many samples a request carries.
    dispatch: Dispatch | list[SGLangClient] = (
        RouterDispatch(router, engines, remove_worker) if router is not None else engines
    )
    args = HookArgs(cfg, router_url or (urls[0] if urls else ""), list(urls), tokenizer)
    gateway = (AgentGateway(args, tokenizer, cfg.rollout.agent_gateway_host)
               if hooks.agent is not None else None)
    try:
        custom_generate = hooks.custom_generate
        if gateway is not None and hooks.agent is not None:
            await gateway.start()
            custom_generate = gateway.generate_fn(hooks.agent)
        loop = build_generation_loop(
            cfg.rollout, dispatch, hooks.rewards, args, target=target,
            custom_generate=custom_generate, dynamic_filter=hooks.dynamic_filter,
            progress=progress, min_weight_version=min_weight_version, watch=watch,
        )
        yield loop
    finally:
        if watch is not None:
            await watch.close()
        if gateway is not None:
            await gateway.stop()
        await asyncio.gather(*(c.aclose() for c in [*engines, *([router] if router else [])]))


async def run_evaluation(
    cfg: RunConfig, urls: list[str], router_url: str | None, tokenizer: Any,
    rewards: RewardHub, eval_fn: EvalFn | None, weight_version: int,
) -> dict[str, float]:
    """The held-out sets' metrics, then the custom eval function's (`eval.eval_function_path`).
    An environment's held-out set (its URI in `eval.datasets`) plays its episodes through an
    agent gateway, as training does."""
    clients = [SGLangClient(url) for url in urls]
    args = HookArgs(cfg, router_url or (urls[0] if urls else ""), list(urls), tokenizer)
    episodes = any(is_environment_uri(d.path) for d in cfg.eval.datasets)
    gateway = AgentGateway(args, tokenizer, cfg.rollout.agent_gateway_host) if episodes else None

    def generate_for(ds: EvalDataset) -> GenerateFn | None:
        if gateway is None or not is_environment_uri(ds.path):
            return None
        return gateway.generate_fn(environment_agent(ds.path))

    try:
        if gateway is not None:
            await gateway.start()
        metrics = await evaluate_datasets(
            cfg.eval.datasets, clients, tokenizer, cfg.rollout, rewards, cfg, cfg.storage,
            generate_for=generate_for,
        )
        if eval_fn is not None:
            metrics.update(await custom_eval_metrics(eval_fn, args, weight_version))
        return metrics
    finally:
        if gateway is not None:
            await gateway.stop()
        await asyncio.gather(*(c.aclose() for c in clients))
