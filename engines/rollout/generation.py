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
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.config.rollout import RolloutConfig
from engines.config.run import RunConfig
from engines.hooks.protocols import GenerateFn
from engines.rollout.agent_gateway import AGENT_COUNTERS, AGENT_REWARD
from engines.rollout.dispatch import Dispatch, Healing, RoundRobinDispatch
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
from storage.sample import Group, Sample, Status

log = logging.getLogger(__name__)
# seconds between abort_all rounds while requests are still in flight (then the last, on)
_REABORT_WAITS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)

FINISH_TO_STATUS = {
    "stop": Status.COMPLETED,
    "length": Status.TRUNCATED,
    "abort": Status.ABORTED,
}
FINISHED = (Status.COMPLETED, Status.TRUNCATED, Status.FAILED)
# An engine client, for the generation loop and evaluation.py: anything with `generate_batch`.
EngineClient = Any


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
class GenerationStats:
    groups: int = 0
    samples: int = 0
    generated_tokens: int = 0
    truncated: int = 0
    aborted: int = 0
    seconds: float = 0.0
    abort_seconds: float = 0.0
    reward_timeouts: int = 0  # samples whose rule reward passed rollout.rm_rule_timeout_s
    tokens_restored: int = 0  # held by groups an earlier attempt committed
    tokens_regenerated: int = 0  # for groups an earlier attempt or a lost engine had in flight
    journal: dict[str, float] = field(default_factory=dict)
    response_lengths: list[int] = field(default_factory=list)
    agent: Counter[str] = field(default_factory=Counter)  # AGENT_COUNTERS summed over samples

    def add_groups(self, groups: list[Group]) -> None:
        for g in groups:
            self.groups += 1
            for s in g:
                self.samples += 1
                self.response_lengths.append(s.response_length)
                self.truncated += s.status == Status.TRUNCATED
                self.aborted += s.status == Status.ABORTED
                self.agent.update({k: int(s.metadata.get(k, 0)) for k in AGENT_COUNTERS})

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
            "rollout/response_len_mean": statistics.fmean(lengths),
            "rollout/response_len_std": statistics.pstdev(lengths),
            "rollout/response_len_min": float(min(lengths)),
            "rollout/response_len_max": float(max(lengths)),
            "rollout/seconds": self.seconds,
            "rollout/abort_seconds": self.abort_seconds,
            "rollout/reward_timeouts": float(self.reward_timeouts),
            "rollout/tokens_restored": float(self.tokens_restored),
            "rollout/tokens_regenerated": float(self.tokens_regenerated),
            **self.journal,
            **self._agent_metrics(),
        }

    def _agent_metrics(self) -> dict[str, float]:
        """Agent rollouts only (engines/rollout/agent_gateway.py says what each one counts)."""
        if not self.agent["agent_turns"]:
            return {}
        return {
            "rollout/agent_turns_mean": self.agent["agent_turns"] / max(self.samples, 1),
            **{f"rollout/{k}": float(self.agent[k]) for k in AGENT_COUNTERS if k != "agent_turns"},
        }


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
    sample.append_response(list(out.output_ids), list(out.log_probs), out.text)
    if out.routed_experts is not None:  # the whole stream's: supersedes an earlier turn's
        sample.routed_experts = out.routed_experts
    sample.status = FINISH_TO_STATUS.get(out.finish_reason.get("type", ""), Status.FAILED)
    sample.weight_version = out.weight_version


def reset_to_prompt(sample: Sample) -> None:
    """Forget a sample's response (a recycled group without partial rollout)."""
    del sample.tokens[sample.prompt_length :]
    sample.response, sample.response_length = "", 0
    sample.loss_mask, sample.rollout_log_probs = [], []
    sample.routed_experts = None
    sample.status, sample.reward, sample.weight_version = Status.PENDING, None, 0
    sample.metadata.pop("start_weight_version", None)


def is_finished(group: Group) -> bool:
    return all(s.status in FINISHED for s in group)


def first_index(group: Group) -> int:
    return group[0].index


def request_cap(cfg: RolloutConfig, filtered: bool, target: int) -> int:
    """Samples one direct request may carry: `max_request_samples` when every group drawn
    must finish anyway, 1 (a request per group) when the step may abort what is left once
    it has `target` groups (a dynamic filter, `filtered`, or over-sampling): a shared
    request ends with its slowest sample, so its stragglers could no longer be cut off."""
    may_abort = filtered or cfg.submit_batch_size > target
    return 1 if may_abort else cfg.max_request_samples


class GenerationLoop:
    """Runs groups through the engines, scores finished groups, and (run_dynamic) keeps
    drawing until enough groups pass the dynamic filter.

    A custom generate function replaces the HTTP call per sample; it must leave the sample
    with a final status (COMPLETED/TRUNCATED, or ABORTED when a turn came back aborted, so
    the group returns to the buffer) and its tokens, loss mask and log-probs extended.
    """

    def __init__(
        self,
        cfg: RolloutConfig,
        dispatch: Dispatch | Sequence[EngineClient],
        reward_fn: RewardHub | RewardFn | None,
        hook_args: Any = None,
        *,
        custom_generate: GenerateFn | None = None,
        dynamic_filter: DynamicFilter | None = None,
        progress: Callable[[int, int], None] | None = None,
        min_weight_version: int | None = None,
        watch: EngineWatch | None = None,
    ) -> None:
        self.cfg = cfg
        self.watch = watch  # probes the engines; a lost one's requests go to the others
        # Buffered samples started on an older policy are regenerated (async max_staleness).
        self.min_weight_version = min_weight_version
        self.stale_regenerated = 0
        # Plain clients (the rollout manager without a router, evaluation, custom rollout
        # functions): groups share requests up to `max_request_samples` where every group
        # finishes (`run`); `run_dynamic` narrows that where it may abort (request_cap).
        self._clients = None if isinstance(dispatch, Dispatch) else list(dispatch)
        self.dispatch: Dispatch = self._watched(
            dispatch if isinstance(dispatch, Dispatch)
            else RoundRobinDispatch(dispatch, cfg.max_request_samples)
        )
        # A bare reward function is the common case (eval, tests); the hub adds group_rm,
        # per-sample metadata.rm_type and remote reward models.
        self.rewards = reward_fn if isinstance(reward_fn, RewardHub) else RewardHub(default=reward_fn)
        self.hook_args = hook_args
        self.custom_generate = custom_generate
        self.dynamic_filter = dynamic_filter
        self.progress = progress  # (groups kept, target), after each batch of finished groups
        self._semaphore = asyncio.Semaphore(cfg.sglang_server_concurrency * self.dispatch.num_engines)
        self._aborting = False
        self.generated_tokens = 0
        self._group_tokens: Counter[int] = Counter()  # generated_tokens by group_index
        self.resumed_samples = 0
        self.reward_timeouts = 0  # every group scored, kept or not: each one stalled the step

    def _watched(self, dispatch: Dispatch) -> Dispatch:
        if self.watch is not None and isinstance(dispatch, Healing):
            dispatch.suspect = self.watch.suspect
        return dispatch

    async def lose_engine(self, url: str, why: str) -> None:
        """The watch's verdict: go on without `url` (the step fails if it was the last)."""
        if isinstance(self.dispatch, Healing):
            await self.dispatch.lose(url)

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
            self.resumed_samples += 1
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
                self.generated_tokens += samples[0].response_length - before
                self._group_tokens[samples[0].group_index] += samples[0].response_length - before
                return
            outs = await self.dispatch.generate(
                [s.tokens for s in samples], params, [f"sample-{s.index}" for s in samples]
            )
        for s, out in zip(samples, outs, strict=True):
            apply_output(s, out)
            self.generated_tokens += len(out.output_ids)
            self._group_tokens[s.group_index] += len(out.output_ids)

    def _regenerate_stale(self, group: Group) -> None:
        """Reset samples whose first token came from a policy older than allowed."""
        oldest = self.min_weight_version
        if oldest is None:
            return
        for s in group:
            started = int(s.metadata.get("start_weight_version", s.weight_version))
            if s.response_length > 0 and started < oldest:
                reset_to_prompt(s)
                self.stale_regenerated += 1

    async def generate_group(self, group: Group) -> Group:
        self._regenerate_stale(group)
        todo = [s for s in group if s.status not in FINISHED]
        live = [(s, p) for s in todo if (p := self._prepare(s)) is not None]
        if live:
            if self.dispatch.per_sample or self.custom_generate is not None:
                await asyncio.gather(*(self._send([s], [p]) for s, p in live))
            else:
                await self._send([s for s, _ in live], [p for _, p in live])
        unscored = [s for s in group if not s.metadata.get(AGENT_REWARD)]
        if is_finished(group) and unscored and (
            self.rewards.configured or any("rm_type" in s.metadata for s in group)
        ):
            await self.rewards.assign(self.hook_args, unscored)
            self.reward_timeouts += sum(bool(s.metadata.get(TIMEOUT_FLAG)) for s in group)
        return group

    # -- a fixed list of groups (evaluation) ---------------------------------------------
    async def run(self, groups: list[Group]) -> tuple[list[Group], GenerationStats]:
        start = time.perf_counter()
        done = await asyncio.gather(*(self.generate_group(g) for g in groups))
        stats = GenerationStats(seconds=time.perf_counter() - start)
        stats.add_groups(done)
        stats.generated_tokens = self.generated_tokens
        stats.reward_timeouts = self.reward_timeouts
        return sorted(done, key=first_index), stats

    # -- dynamic sampling with abort (training) ------------------------------------------
    def _accepts(self, group: Group) -> bool:
        return self.dynamic_filter is None or bool(self.dynamic_filter(self.hook_args, group))

    async def run_dynamic(
        self, source: GroupSource, target: int, journal: StepLog | None = None,
        restored: Restored | None = None,
    ) -> RolloutResult:
        """Keep `target` groups that pass the dynamic filter, then abort the rest. Each draw
        and each group the loop is done with goes to `journal` as it happens; `restored` is
        the state of an earlier attempt of this step (engines/rollout/restore.py): its
        groups count as done, its in-flight ones are sent again."""
        if self._clients is not None:
            cap = request_cap(self.cfg, self.dynamic_filter is not None, target)
            self.dispatch = self._watched(RoundRobinDispatch(self._clients, cap))
        log_ = journal or NullLog()
        r = restored or Restored()
        start = time.perf_counter()
        limit = self.cfg.max_groups_per_step or 10 * target
        pending: dict[asyncio.Task[Group], Group] = {}
        kept, returned = list(r.kept), list(r.returned)
        counts = dict.fromkeys(("drawn", "dropped", "failed", "aborted", "surplus"), 0)
        counts.update(r.counts, drawn=r.drawn)
        for g in r.in_flight:
            pending[asyncio.ensure_future(self.generate_group(g))] = g
        again = {g[0].group_index for g in r.in_flight}
        try:
            try:
                while len(kept) < target:
                    while len(kept) + len(pending) < target and counts["drawn"] < limit:
                        n = min(self.cfg.submit_batch_size, limit - counts["drawn"])
                        drawn = source.get_samples(n)
                        log_.drawn(n, drawn, cursor_of(source))
                        for g in drawn:
                            counts["drawn"] += 1
                            pending[asyncio.ensure_future(self.generate_group(g))] = g
                    if not pending:
                        log.warning("dynamic sampling drew %d groups and kept only %d of %d",
                                    counts["drawn"], len(kept), target)
                        break
                    done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in sorted(done, key=lambda t: first_index(pending[t])):
                        group = pending.pop(task)
                        task.result()
                        outcome = self._loop_outcome(group)
                        log_.finished(group, outcome, LOOP)
                        if outcome == Outcome.KEPT:
                            kept.append(group)
                        elif outcome == Outcome.RETURNED:  # aborted by someone else: keep the work
                            returned.append(group)
                        else:
                            counts[outcome] += 1
                    log_.commit()
                    if self.progress is not None:
                        self.progress(len(kept), target)
            except BaseException:
                await self._abort_and_drain(pending)  # leave no request running on the engines
                raise
            kept.sort(key=first_index)
            surplus = kept[target:]
            del kept[target:]
            abort_start = time.perf_counter()
            drained = list(r.drained)
            for group in await self._abort_and_drain(pending):
                outcome = self._drain_outcome(group)
                log_.finished(group, outcome, DRAIN)
                drained.append((group, outcome))
            log_.commit()
        finally:
            await log_.flush()
        for group, outcome in drained:
            if outcome == Outcome.SURPLUS:
                surplus.append(group)
            elif outcome == Outcome.ABORTED:
                counts["aborted"] += 1
                returned.append(group)
            else:
                counts[outcome] += 1
        counts["surplus"] = len(surplus)
        returned.extend(surplus)
        if not self.cfg.partial_rollout:
            for s in (s for g in returned for s in g):
                reset_to_prompt(s)
        counts["kept"] = len(kept)
        counts["returned"] = len(returned)
        counts["restored"] = r.groups
        stats = GenerationStats(seconds=time.perf_counter() - start)
        stats.add_groups(kept)
        stats.generated_tokens = self.generated_tokens
        stats.tokens_restored = r.tokens
        stats.tokens_regenerated = sum(
            self._group_tokens.get(gi, 0) for gi in again) + self.resent_tokens
        stats.reward_timeouts = self.reward_timeouts
        stats.abort_seconds = time.perf_counter() - abort_start
        stats.journal = log_.metrics()
        counts["resumed_samples"] = self.resumed_samples
        counts["stale_regenerated_samples"] = self.stale_regenerated
        return RolloutResult(kept, sorted(returned, key=first_index), stats, counts)

    def _loop_outcome(self, group: Group) -> Outcome:
        if not is_finished(group):
            return Outcome.RETURNED
        if any(s.status == Status.FAILED for s in group):
            return Outcome.FAILED
        return Outcome.KEPT if self._accepts(group) else Outcome.DROPPED

    def _drain_outcome(self, group: Group) -> Outcome:
        if not is_finished(group):
            return Outcome.ABORTED
        if any(s.status == Status.FAILED for s in group):
            return Outcome.FAILED
        return Outcome.SURPLUS if self._accepts(group) else Outcome.DROPPED

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
