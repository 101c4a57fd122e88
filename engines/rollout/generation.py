"""The generation loop (slime's generate_rollout_async): over-sample, filter, abort, recycle.

```
 data source ──get_samples(over_sampling_batch_size)──► pending groups ◄─────────────┐
                                                            │                        │
        semaphore (sglang_server_concurrency x engines) ◄───┘                        │
                 │  router: one request per sample / direct: one per group            │
                 ▼                                                                    │
          engines /generate ──► group finished ──► rewards ──► dynamic filter        │
                                                                  │ keep   │ drop      │
                                                                  ▼        ▼           │
                                              kept < target? ── yes: draw more ───────┘
                                                   │ no
                                                   ▼
      abort_all on every engine, drain pending ──► unfinished groups (partial tokens) and
      surplus finished groups go back to the buffer whole; kept groups, sorted by index
```
Every draw and every group the loop is done with (kept, dropped, returned, drained) is
appended to the step's group journal as it happens, so a rerun of a crashed step takes those
groups back and sends again only what was in flight (engines/rollout/restore.py).
Each sample carries `sampling_seed = rollout.seed + sample.index`, so its response depends only
on its index and the weights; a resumed run regenerates what an uninterrupted one would have.
A partial sample is continued by sending prompt + partial response as `input_ids` with the
token budget it has left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.config.rollout import RolloutConfig
from engines.config.run import RunConfig
from engines.hooks.protocols import GenerateFn
from engines.rollout.agent_gateway import AGENT_REWARD
from engines.rollout.dispatch import Dispatch, EngineClient, Healing, RoundRobinDispatch
from engines.rollout.engine_watch import EngineWatch
from engines.rollout.filters import DynamicFilter
from engines.rollout.restore import (
    DRAIN,
    LOOP,
    GroupSource,
    NullLog,
    Outcome,
    Restored,
    StepLog,
    cursor_of,
)
from engines.rollout.rewards.deadline import TIMEOUT_FLAG
from engines.rollout.rewards.hub import RewardHub
from engines.rollout.rewards.rm_hub import RewardFn
from engines.rollout.sglang_client import GenerateOutput
from engines.rollout.step_groups import (
    GenerationStats,
    LoopTally,
    StepGroups,
    first_index,
    reset_to_prompt,
)
from storage.sample import Group, Sample, Status

log = logging.getLogger(__name__)
# seconds between abort_all rounds while requests are still in flight (then the last, on)
_REABORT_WAITS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
STALE_DROPPED = "stale_dropped"
"""`sample.metadata` flag of a group dropped as stale (`rollout.stale_groups: drop`)."""

FINISH_TO_STATUS = {
    "stop": Status.COMPLETED,
    "length": Status.TRUNCATED,
    "abort": Status.ABORTED,
}
FINISHED = (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)


@dataclass(slots=True)
class HookArgs:
    """`args` of custom generate functions (and every hook the loop calls): the run config's
    attributes, plus where to send requests: `engine_url` is the router (or the first
    engine), see `engines.hooks.protocols.engine_url`.

    `config` is the whole run config, read through `engines.config.run.RunConfig` (its
    sections: `args.rollout.temperature`, `args.data.input_key`, ...); attribute access
    passes through to it, as slime's hooks read its argument namespace."""

    config: RunConfig
    engine_url: str = ""
    engine_urls: list[str] = field(default_factory=list)
    tokenizer: Any = None

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "config"), name)


@dataclass
class RolloutResult:
    """What one step's generation produced: `kept` (sorted by index) is trained; `returned`
    goes back to the buffer whole; dropped/failed groups are only counted."""

    kept: list[Group]
    returned: list[Group]
    stats: GenerationStats
    counts: dict[str, int]
    lost_engines: dict[str, str] = field(default_factory=dict)  # url -> why (EngineWatch)
    resent_samples: int = 0  # sent again after the engine they were on was lost
    engines: int = 0  # the engines the step started with (the run's pool)
    engine_requests: dict[str, int] = field(default_factory=dict)  # by URL (round-robin only)
    first_failure: str | None = None  # why the first failed group failed (step_groups)

    @classmethod
    def of_step(
        cls, groups: StepGroups, stats: GenerationStats, restored_groups: int,
        loop: GenerationLoop,
    ) -> RolloutResult:
        """The step's result once `groups` is settled; the loop's counts, and the engine
        pool's figures from its dispatch and watch."""
        counts = {**groups.counts, "kept": len(groups.kept), "returned": len(groups.returned),
                  "restored": restored_groups, "resumed_samples": loop.tally.resumed_samples,
                  "stale_regenerated_samples": loop.tally.stale_regenerated,
                  "stale_dropped": loop.tally.stale_dropped}
        return cls(groups.kept, groups.returned, stats, counts,
                   lost_engines=dict(loop.watch.lost) if loop.watch is not None else {},
                   resent_samples=loop.resent_samples, engines=loop.dispatch.num_engines,
                   engine_requests=loop.engine_requests, first_failure=groups.first_failure)

    def metrics(self) -> dict[str, float]:
        healing = {"rollout/engines_lost": float(len(self.lost_engines)),
                   "rollout/resent_samples": float(self.resent_samples)}
        pool = {"rollout/engines": float(self.engines)} if self.engines else {}
        if self.engine_requests:  # an engine that served nothing counts as 0
            served = [*self.engine_requests.values(),
                      *[0] * max(self.engines - len(self.engine_requests), 0)]
            pool |= {"rollout/engine_requests_min": float(min(served)),
                     "rollout/engine_requests_max": float(max(served))}
        return {**self.stats.as_metrics(),
                **{f"rollout/groups_{k}": float(v) for k, v in self.counts.items()},
                **(healing if self.lost_engines or self.resent_samples else {}), **pool}


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
        "ignore_eos": cfg.ignore_eos,
        "sampling_seed": cfg.seed + sample.index,
    }


def apply_output(sample: Sample, out: GenerateOutput) -> None:
    sample.metadata.setdefault("start_weight_version", out.weight_version)
    sample.append_response(list(out.output_ids), list(out.log_probs), out.text,
                           out.token_versions or [out.weight_version] * len(out.output_ids))
    if out.routed_experts is not None:  # the whole stream's: supersedes an earlier turn's
        sample.routed_experts = out.routed_experts
    sample.status = FINISH_TO_STATUS.get(out.finish_reason.get("type", ""), Status.FAILED)
    sample.weight_version = out.weight_version


def is_finished(group: Group) -> bool:
    return all(s.status in FINISHED for s in group)


def request_cap(cfg: RolloutConfig, filtered: bool, target: int) -> int:
    """Samples one direct request may carry: `max_request_samples` when every group drawn
    must finish anyway, 1 (a request per group) when the step may abort what is left once
    it has `target` groups (a dynamic filter, `filtered`, or over-sampling): a shared
    request ends with its slowest sample, so its stragglers could no longer be cut off."""
    may_abort = filtered or cfg.submit_batch_size > target
    return 1 if may_abort else cfg.max_request_samples


def build_generation_loop(
    cfg: RolloutConfig,
    engines: Dispatch | Sequence[EngineClient],
    rewards: RewardHub | RewardFn | None = None,
    hook_args: Any = None,
    *,
    target: int | None = None,
    custom_generate: GenerateFn | None = None,
    dynamic_filter: DynamicFilter | None = None,
    progress: Callable[[int, int], None] | None = None,
    min_weight_version: int | None = None,
    watch: EngineWatch | None = None,
) -> GenerationLoop:
    """A loop over a built dispatch. `target` is the groups `run_dynamic` keeps; None for a
    loop that only runs a fixed list (`run`, evaluation).

    Plain clients (the rollout manager without a router, evaluation, custom rollout
    functions) go round-robin: groups share requests up to `max_request_samples` where
    every group finishes, one request per group where the loop may abort (request_cap).
    A bare reward function is the common case (eval, tests); the hub adds group_rm,
    per-sample metadata.rm_type and remote reward models."""
    if isinstance(engines, Dispatch):
        dispatch = engines
    else:
        cap = (cfg.max_request_samples if target is None
               else request_cap(cfg, dynamic_filter is not None, target))
        dispatch = RoundRobinDispatch(engines, cap)
    if watch is not None and isinstance(dispatch, Healing):
        dispatch.suspect = watch.suspect
    hub = rewards if isinstance(rewards, RewardHub) else RewardHub(default=rewards)
    return GenerationLoop(
        cfg, dispatch, hub, hook_args, target=target, custom_generate=custom_generate,
        dynamic_filter=dynamic_filter, progress=progress,
        min_weight_version=min_weight_version, watch=watch,
    )


class GenerationLoop:
    """Runs groups through the engines, scores finished groups, and (run_dynamic) keeps
    drawing until `target` groups pass the dynamic filter. Built by `build_generation_loop`.

    A custom generate function replaces the HTTP call per sample; it must leave the sample
    with a final status (COMPLETED/TRUNCATED, or ABORTED when a turn came back aborted, so
    the group returns to the buffer) and its tokens, loss mask and log-probs extended.
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        dispatch: Dispatch,
        rewards: RewardHub,
        hook_args: Any,
        *,
        target: int | None,
        custom_generate: GenerateFn | None,
        dynamic_filter: DynamicFilter | None,
        progress: Callable[[int, int], None] | None,
        min_weight_version: int | None,
        watch: EngineWatch | None,
    ) -> None:
        self.cfg = cfg
        self.dispatch = dispatch
        self.rewards = rewards
        self.hook_args = hook_args
        self.target = target
        self.custom_generate = custom_generate
        self.dynamic_filter = dynamic_filter
        self.progress = progress  # (groups kept, target), after each batch of finished groups
        # Buffered samples started on an older policy are regenerated (async max_staleness).
        self.min_weight_version = min_weight_version
        self.watch = watch  # probes the engines; names the lost ones in the result
        self.tally = LoopTally()
        self._semaphore = asyncio.Semaphore(cfg.sglang_server_concurrency * dispatch.num_engines)
        self._aborting = False

    def refuse_new_requests(self) -> None:
        """From now on no request is sent (the async loop stopping); those in flight run on
        until aborted."""
        self._aborting = True

    async def lose_engine(self, url: str, why: str) -> None:
        """The watch's verdict: go on without `url` (the step fails if it was the last)."""
        if isinstance(self.dispatch, Healing):
            await self.dispatch.lose(url, why)

    @property
    def resent_samples(self) -> int:
        return self.dispatch.resent_samples if isinstance(self.dispatch, Healing) else 0

    @property
    def resent_tokens(self) -> int:
        """Tokens generated by requests sent again after their engine was lost: that
        engine's partial output is lost with it, so these bound what it threw away."""
        return self.dispatch.resent_tokens if isinstance(self.dispatch, Healing) else 0

    @property
    def engine_requests(self) -> dict[str, int]:
        """Requests each engine answered, by URL, where the loop picks the engine (the
        router does not say which engine served a request)."""
        return dict(getattr(self.dispatch, "served", {}))

    # -- one group -----------------------------------------------------------------------
    def _prepare(self, s: Sample) -> dict[str, Any] | None:
        """Sampling params for a sample that still needs tokens (None if it needs none)."""
        params = sampling_params_for(self.cfg, s)
        if params["max_new_tokens"] <= 0:
            s.status = Status.TRUNCATED
            return None
        if s.response_length > 0:
            self.tally.resumed_samples += 1
            if self.cfg.mask_offpolicy_in_partial_rollout:
                s.loss_mask = [0] * s.response_length
        return params

    async def _send(self, samples: list[Sample], params: list[dict[str, Any]]) -> None:
        async with self._semaphore:
            if self._aborting:  # never start new work once the step has what it needs
                return
            if self.custom_generate is not None:
                before = samples[0].response_length
                await self.custom_generate(self.hook_args, samples[0], params[0])
                self.tally.generated(samples[0], samples[0].response_length - before)
                return
            outs = await self.dispatch.generate(
                [s.tokens for s in samples], params, [f"sample-{s.index}" for s in samples]
            )
        for s, out in zip(samples, outs, strict=True):
            apply_output(s, out)
            self.tally.generated(s, len(out.output_ids))

    def _stale_samples(self, group: Group) -> list[Sample]:
        """Samples whose first token came from a policy older than allowed."""
        oldest = self.min_weight_version
        if oldest is None:
            return []
        return [s for s in group if s.response_length > 0
                and int(s.metadata.get("start_weight_version", s.weight_version)) < oldest]

    def _handle_stale(self, group: Group) -> bool:
        """Start stale samples over (`rollout.stale_groups: regenerate`), or mark the whole
        group dropped (`drop`); True when it was dropped."""
        stale = self._stale_samples(group)
        if stale and self.cfg.stale_groups == "drop":
            for s in group:
                s.metadata[STALE_DROPPED] = True
            self.tally.stale_dropped += 1
            return True
        for s in stale:
            reset_to_prompt(s)
            self.tally.stale_regenerated += 1
        return False

    async def generate_group(self, group: Group) -> Group:
        if self._handle_stale(group):
            return group  # neither generated nor scored: DROPPED by `_outcome`
        todo = [s for s in group if s.status not in FINISHED]
        live = [(s, p) for s in todo if (p := self._prepare(s)) is not None]
        if live:
            if self.dispatch.per_sample or self.custom_generate is not None:
                await asyncio.gather(*(self._send([s], [p]) for s, p in live))
            else:
                await self._send([s for s, _ in live], [p for _, p in live])
        # The step's rewards are computed here, as each group finishes, not in the reward
        # stage: the dynamic filter judges a group by its rewards before the loop decides to
        # keep it or draw more (slime does the same). The reward stage only makes them scalars.
        unscored = [s for s in group if not s.metadata.get(AGENT_REWARD)]
        if is_finished(group) and unscored and (
            self.rewards.configured or any("rm_type" in s.metadata for s in group)
        ):
            await self.rewards.assign(self.hook_args, unscored)
            self.tally.reward_timeouts += sum(bool(s.metadata.get(TIMEOUT_FLAG)) for s in group)
            self.tally.judged(group)
        return group

    # -- a fixed list of groups (evaluation) ---------------------------------------------
    async def run(self, groups: list[Group]) -> tuple[list[Group], GenerationStats]:
        start = time.perf_counter()
        done = await asyncio.gather(*(self.generate_group(g) for g in groups))
        stats = GenerationStats.of(done, self.tally, time.perf_counter() - start)
        return sorted(done, key=first_index), stats

    # -- dynamic sampling with abort (training) ------------------------------------------
    def _accepts(self, group: Group) -> bool:
        return self.dynamic_filter is None or bool(self.dynamic_filter(self.hook_args, group))

    async def run_dynamic(
        self, source: GroupSource, journal: StepLog | None = None,
        restored: Restored | None = None,
    ) -> RolloutResult:
        """Keep `target` groups that pass the dynamic filter, then abort the rest. Each draw
        and each group the loop is done with goes to `journal` as it happens; `restored` is
        the state of an earlier attempt of this step (engines/rollout/restore.py): its
        groups count as done, its in-flight ones are sent again. The watch, if any, probes
        the engines meanwhile."""
        if self.target is None:
            raise ValueError("run_dynamic needs a loop built with a target")
        r = restored or Restored()
        watching = asyncio.ensure_future(self.watch.run()) if self.watch is not None else None
        try:
            groups, stats = await self._step(self.target, source, journal or NullLog(), r)
        finally:
            if watching is not None:
                watching.cancel()
                await asyncio.gather(watching, return_exceptions=True)
        return RolloutResult.of_step(groups, stats, r.groups, self)

    async def _step(
        self, target: int, source: GroupSource, log_: StepLog, r: Restored,
    ) -> tuple[StepGroups, GenerationStats]:
        start = time.perf_counter()
        groups = StepGroups.restored(r)
        pending = {asyncio.ensure_future(self.generate_group(g)): g for g in r.in_flight}
        try:
            try:
                await self._draw_until_kept(target, source, pending, groups, log_)
            except BaseException:
                await self._abort_and_drain(pending)  # leave no request running on the engines
                raise
            groups.trim(target)
            abort_start = time.perf_counter()
            for group, outcome in r.drained:
                groups.add(group, outcome)
            for group in await self._abort_and_drain(pending):
                outcome = self._outcome(group, DRAIN)
                log_.finished(group, outcome, DRAIN)
                groups.add(group, outcome)
            log_.commit()
        finally:
            await log_.flush()
        groups.settle(self.cfg.partial_rollout)
        end = time.perf_counter()
        again = sum(self.tally.group_tokens.get(g[0].group_index, 0) for g in r.in_flight)
        stats = GenerationStats.of(
            groups.kept, self.tally, end - start, abort_seconds=end - abort_start,
            tokens_restored=r.tokens, tokens_regenerated=again + self.resent_tokens,
            journal=log_.metrics(),
        )
        return groups, stats

    async def _draw_until_kept(
        self, target: int, source: GroupSource, pending: dict[asyncio.Task[Group], Group],
        groups: StepGroups, log_: StepLog,
    ) -> None:
        """Draw and send until `target` groups are kept, or the step drew all it may."""
        limit = self.cfg.max_groups_per_step or 10 * target
        while len(groups.kept) < target:
            while len(groups.kept) + len(pending) < target and groups.counts["drawn"] < limit:
                n = min(self.cfg.submit_batch_size, limit - groups.counts["drawn"])
                drawn = source.get_samples(n)
                log_.drawn(n, drawn, cursor_of(source))
                groups.counts["drawn"] += len(drawn)
                pending.update((asyncio.ensure_future(self.generate_group(g)), g) for g in drawn)
            if not pending:
                log.warning("dynamic sampling drew %d groups and kept only %d of %d",
                            groups.counts["drawn"], len(groups.kept), target)
                return
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: first_index(pending[t])):
                group = pending.pop(task)
                task.result()
                outcome = self._outcome(group, LOOP)
                log_.finished(group, outcome, LOOP)
                groups.add(group, outcome)
            log_.commit()
            if self.progress is not None:
                self.progress(len(groups.kept), target)

    def _outcome(self, group: Group, phase: str) -> Outcome:
        """In the loop an unfinished group was aborted by someone else (RETURNED) and an
        accepted one is KEPT; while draining they are ABORTED and SURPLUS. A group dropped
        as stale is DROPPED whatever its state."""
        if group and group[0].metadata.get(STALE_DROPPED):
            return Outcome.DROPPED
        if not is_finished(group):
            return Outcome.RETURNED if phase == LOOP else Outcome.ABORTED
        if any(s.status == Status.FAILED for s in group):
            return Outcome.FAILED
        if not self._accepts(group):
            return Outcome.DROPPED
        return Outcome.KEPT if phase == LOOP else Outcome.SURPLUS

    async def _abort_and_drain(self, pending: dict[asyncio.Task[Group], Group]) -> list[Group]:
        """abort_all on every engine until nothing is in flight. Repeated, because a request
        can reach an engine just after an abort (sent before the step had its groups); it
        then runs to completion unless aborted again. The first repeats come soon
        (`_REABORT_WAITS`): with one abort a second, such a request on a small model would
        have many times the time it takes to finish its tokens."""
        if not pending:
            return []
        drained: list[Group] = []
        self._aborting = True
        try:
            waits = iter(_REABORT_WAITS)
            while pending:
                await self.dispatch.abort_all()
                done, _ = await asyncio.wait(pending, timeout=next(waits, _REABORT_WAITS[-1]))
                for task in done:
                    group = pending.pop(task)
                    if task.exception() is not None:
                        log.warning("group %d failed while draining: %r",
                                    group[0].group_index, task.exception())
                    drained.append(group)
        finally:
            self._aborting = False
        return drained
