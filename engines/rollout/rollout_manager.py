"""The rollout side of a run, as one long-lived actor: data source, generation, filter, reward.

Every method reads its input from and writes its output to the run directory and returns a
small typed record (engines/records.py), so the Prefect tasks that call it stay thin, and any method can be re-run after a
crash from what is on storage. The data source is reloaded from the previous step's saved
state before drawing, so the in-memory state never has to survive a restart.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from engines.chat.tokenizer import load_tokenizer
from engines.config.rollout import RolloutConfig
from engines.config.run import RunConfig
from engines.data.data_source import (
    RolloutDataSourceWithBuffer,
    groups_in_order,
    pop_first,
    save_source_state,
)
from engines.data.prompt_dataset import data_spec, model_context, open_prompt_dataset, prompt_limit
from engines.environments.registry import close_environments
from engines.environments.rows import environment_agent
from engines.hooks.loader import load_hook, load_user_hook, returned_groups
from engines.hooks.protocols import AgentFn, EvalFn, GenerateFn, RolloutFn, SampleFilterFn
from engines.process import freeze_actor_heap
from engines.records import FilterRecord, GenerateRecord, RewardRecord, SamplePromptsRecord
from engines.rollout.async_producer import AsyncProducer
from engines.rollout.filters import (
    resolve_dynamic_filter,
    resolve_over_sampling_filter,
)
from engines.rollout.generation import (
    is_finished,
)
from engines.rollout.generation_session import (
    LoopHooks,
    generation_session,
    run_evaluation,
    run_generation,
)
from engines.rollout.restore import (
    JournalLog,
    JournalMismatch,
    NullLog,
    Restored,
    StepLog,
    replay,
    settings_fingerprint,
)
from engines.rollout.rewards.hub import RewardHub
from engines.rollout.router import RouterProcess
from engines.rollout.staleness import staleness_metrics
from engines.weights.schedule import oldest_trainable_version, required_weight_version
from storage.batch_io import read_samples, write_samples
from storage.group_journal import GroupJournal
from storage.object_store import open_store
from storage.run_layout import RunLayout, step_dir
from storage.sample import Group, Status, flatten

log = logging.getLogger(__name__)


class EveryGroupFailed(RuntimeError):
    """A step whose every finished group failed (an agent or environment that raises, a
    server it needs that is down): nothing to train, and the first failure says why."""

    def __init__(self, rollout_id: int, failed: int, drawn: int, first: str | None) -> None:
        super().__init__(
            f"rollout {rollout_id}: every group failed ({failed} of {drawn} drawn), so there "
            f"is nothing to train; the first: {first or 'see the rollout actor log'}")
        self.rollout_id, self.failed, self.drawn, self.first = rollout_id, failed, drawn, first

    def __reduce__(self) -> tuple[Any, ...]:  # (Ray pickles it across to the driver)
        return type(self), (self.rollout_id, self.failed, self.drawn, self.first)


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

    def cursor(self) -> dict[str, Any]:
        """Where the next draw starts: what is left of sample_prompts' groups, the data
        source's state and its buffer (a replayed draw must end at the same place)."""
        return {"prompts_left": len(self._drawn), **asdict(self._source.state),
                "buffer_groups": len(self._source.buffer)}

    def unused(self) -> list[Group]:
        """Groups sample_prompts drew that the rollout never asked for (back to the buffer)."""
        taken, self._drawn = self._drawn, []
        return taken


def tokenizer_path(cfg: RunConfig) -> str | None:
    return cfg.engine.model_path or cfg.train.model_path or cfg.train.load


def split_for_training(groups: list[Group], target: int) -> tuple[list[Group], list[Group]]:
    """(kept, back to the buffer) for a custom rollout function's output: unfinished groups
    and finished ones beyond `target` wait in the buffer, whole."""
    finished = [g for g in groups if is_finished(g)]
    unfinished = [g for g in groups if not is_finished(g)]
    return finished[:target], unfinished + finished[target:]


class ProgressFile:
    """Writes `steps/{k}/generate.progress.json` (at most every `interval_s`), which the
    generate task turns into a Prefect progress artifact while the actor is busy."""

    def __init__(self, layout: RunLayout, rollout_id: int, interval_s: float = 0.5) -> None:
        self.layout, self.rollout_id, self.interval_s = layout, rollout_id, interval_s
        self._last = 0.0

    def __call__(self, kept: int, target: int) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s and kept < target:
            return
        self._last = now
        self.layout.store.write_json({"kept": kept, "target": target},
                                     step_dir(self.rollout_id), "generate.progress.json")


class RolloutManager:
    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.layout = RunLayout.open(
            cfg.storage.uri,
            cfg.storage.run_name,
            cfg.storage.endpoint_url,
            cfg.storage.store_options(),
        )
        self.tokenizer = self._load_tokenizer()
        limit = prompt_limit(  # as preflight computed it in the driver
            cfg.data.rollout_max_prompt_len, model_context(tokenizer_path(cfg)),
            cfg.rollout.max_response_len,
        )
        buffer_filter = (
            load_user_hook(cfg.rollout.buffer_filter_path, "rollout.buffer_filter_path", 4)
            if cfg.rollout.buffer_filter_path
            else pop_first
        )
        self.data_source = RolloutDataSourceWithBuffer(
            open_prompt_dataset(data_spec(cfg.data, cfg.storage, limit), self.tokenizer),
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
        r = cfg.rollout
        self.hooks = LoopHooks(
            rewards=RewardHub.from_config(r),
            dynamic_filter=resolve_dynamic_filter(r.dynamic_sampling_filter_path),
            custom_generate=(
                load_hook(r.custom_generate_function_path,
                          "rollout.custom_generate_function_path", GenerateFn)
                if r.custom_generate_function_path else None
            ),
            agent=run_agent(r),
        )
        self.rewards = self.hooks.rewards
        self.eval_fn: EvalFn | None = (
            load_user_hook(cfg.eval.eval_function_path, "eval.eval_function_path", EvalFn)
            if cfg.eval.eval_function_path else None
        )
        self.over_sampling_filter = resolve_over_sampling_filter(r.over_sampling_filter_path)
        self.sample_filter: SampleFilterFn | None = (
            load_user_hook(r.sample_filter_path, "rollout.sample_filter_path", SampleFilterFn)
            if r.sample_filter_path else None
        )
        self.engine_urls: list[str] = []
        self.router: RouterProcess | None = None
        self.producer: AsyncProducer | None = None  # async mode's loop, across steps
        freeze_actor_heap()

    def _load_tokenizer(self) -> Any:
        path = tokenizer_path(self.cfg)
        if path is None:
            return None
        return load_tokenizer(path)

    # -- engines and the router ----------------------------------------------------------
    def set_engines(self, urls: list[str]) -> None:
        """Engines of this run; with `rollout.use_router` the router is (re)started or its
        worker set brought in line with `urls`."""
        self.engine_urls = list(urls)
        if not (self.cfg.rollout.use_router and urls):
            return
        if self.router is None:
            self.router = RouterProcess(urls, policy=self.cfg.rollout.router_policy)
            self.router.start()
        else:
            self.router.ensure_alive()
            self.router.sync_workers(urls)

    def router_url(self) -> str | None:
        """The router's URL after making sure it runs (restarted if it died)."""
        if self.router is None:
            return None
        self.router.ensure_alive()
        return self.router.url

    def router_restarts(self) -> int:
        return 0 if self.router is None else self.router.restarts

    def shutdown(self) -> None:
        self._stop_producer()
        if self.router is not None:
            self.router.shutdown()
            self.router = None
        close_environments()

    def _compression(self) -> str | None:
        return self.cfg.storage.compression

    def _restore_source(self, rollout_id: int) -> None:
        """Data source as committed by the previous step (or fresh at step 0)."""
        if rollout_id == 0:
            self.data_source.reset()
            return
        meta = self.data_source.load(self.layout, rollout_id - 1)
        if meta.get("stage", "generate") != "generate":
            # Drawing now would hand out again the groups step k-1 still has to return.
            raise RuntimeError(
                f"step {rollout_id}: the data source of step {rollout_id - 1} is at stage "
                f"{meta['stage']!r}; its generate must commit before this step draws prompts"
            )

    def _debug_source_layout(self) -> RunLayout:
        s = self.cfg.storage
        uri = self.cfg.rollout.debug_rollout_data or ""
        return RunLayout(open_store(uri, s.endpoint_url, **s.options_for(uri)))

    # -- step stages ---------------------------------------------------------------------
    def sample_prompts(self, rollout_id: int) -> SamplePromptsRecord:
        if self.cfg.rollout.debug_train_only:
            return SamplePromptsRecord(groups=0, debug_train_only=True)
        if self.cfg.rollout.mode == "async":  # the async loop draws as it goes
            return SamplePromptsRecord(groups=0)
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
        state = self.data_source.state
        return SamplePromptsRecord(uri=uri, groups=len(groups), epoch=state.epoch_id,
                                   rows_dropped=state.rows_dropped or None)

    def _keep_target(self) -> int:
        """Groups generation keeps: the over-sampling filter chooses among more."""
        r = self.cfg.rollout
        return r.submit_batch_size if self.over_sampling_filter else r.rollout_batch_size

    def generate(self, rollout_id: int) -> GenerateRecord:
        """Generate, then in one commit (the data-source JSON): rollout.arrow with the kept
        groups, and every other drawn group back in the buffer, whole. A re-run after that
        commit returns the committed record instead of drawing again; a re-run before it
        takes back the groups the step's journal holds and generates only the rest."""
        if self.cfg.rollout.debug_train_only:
            return self._copy_debug_batch(rollout_id)
        if self.cfg.rollout.mode == "async":
            return self._take_async(rollout_id)
        journal = GroupJournal(self.layout.store, step_dir(rollout_id))
        meta = self.data_source.load(self.layout, rollout_id)
        if meta.get("stage") == "generate":
            journal.clear()  # left by a crash between the commit and its removal
            return GenerateRecord.from_json(meta["extra"])
        step_source = self._step_source(rollout_id)
        target = self._keep_target()
        metrics: dict[str, float] = {}
        lost: list[str] = []
        if self.rollout_fn is not None:
            groups = self.rollout_fn(self.cfg, rollout_id, step_source, False)
            kept, returned = split_for_training(
                returned_groups(self.rollout_fn, "rollout.function_path", groups), target
            )
        else:
            step_source, restored, step_log = self._resume(rollout_id, step_source, journal)
            router_retries = self.router.generate_retries() if self.router is not None else None
            result = asyncio.run(run_generation(
                self.cfg, self.engine_urls, self.router_url(), self.hooks, step_source, target,
                self.tokenizer, progress=ProgressFile(self.layout, rollout_id),
                min_weight_version=oldest_trainable_version(self.cfg, rollout_id),
                journal=step_log, restored=restored,
                router_workers=self.router.sync_workers if self.router is not None else None,
            ))
            if not result.kept and result.counts.get("failed"):
                # A retry or a rerun (the server it needed back up) plays the step again from
                # its committed draw, not the journal's record of failures.
                journal.clear()
                raise EveryGroupFailed(rollout_id, result.counts["failed"],
                                       result.counts.get("drawn", 0), result.first_failure)
            kept, returned = result.kept, result.returned
            metrics.update(result.metrics())
            if router_retries is not None and self.router is not None:
                # requests the router itself sent to another engine (a killed one's)
                retried = self.router.generate_retries() - router_retries
                if retried > 0 or result.lost_engines:
                    metrics["rollout/router_retries"] = float(max(retried, 0))
            # (generated samples only: a custom rollout function's, e.g. SFT's, were not)
            metrics.update(staleness_metrics(flatten(kept), trained_version=rollout_id))
            lost = sorted(result.lost_engines)
        uri = write_samples(
            self.layout.store,
            flatten(kept),
            step_dir(rollout_id),
            "rollout.arrow",
            compression=self._compression(),
        )
        self.data_source.add_samples(returned + step_source.unused())
        record = GenerateRecord(uri=uri, groups=len(kept), extra_draws=step_source.extra_draws,
                                buffer_groups=len(self.data_source.buffer),
                                rollout_metrics=metrics, lost_engines=lost)
        self.data_source.save(self.layout, rollout_id, self._compression(), "generate",
                              record.to_json())
        journal.clear()  # committed: rollout.arrow and the buffer hold all it had
        return record

    # -- async mode (engines/rollout/async_producer.py) ----------------------------------
    def _take_async(self, rollout_id: int) -> GenerateRecord:
        """The first rollout_batch_size groups the async loop finished, to rollout.arrow; in
        one commit with them, the loop's snapshot as the data source's state (what a
        restarted loop starts from). A re-run after that commit returns its record."""
        parts = self.layout.datasource_parts(rollout_id, ".json")
        if self.layout.store.exists(*parts):
            meta = self.layout.store.read_json(*parts)
            if meta.get("stage") == "generate":
                return GenerateRecord.from_json(meta["extra"])
        producer = self._producer_at(rollout_id)
        taken = producer.take(rollout_id, self.cfg.rollout.rollout_batch_size,
                              required_weight_version(self.cfg, rollout_id),
                              ProgressFile(self.layout, rollout_id))
        try:
            uri = write_samples(self.layout.store, flatten(taken.groups), step_dir(rollout_id),
                                "rollout.arrow", compression=self._compression())
            state, buffer = producer.snapshot()
            metrics = {**taken.metrics(),
                       **staleness_metrics(flatten(taken.groups), trained_version=rollout_id)}
            record = GenerateRecord(uri=uri, groups=len(taken.groups), extra_draws=0,
                                    buffer_groups=len(buffer), rollout_metrics=metrics,
                                    lost_engines=taken.lost_engines)
            save_source_state(self.layout, rollout_id, state, buffer, self._compression(),
                              "generate", record.to_json())
        except BaseException:
            producer.put_back(rollout_id, taken.groups)  # not committed: the next attempt takes them
            raise
        if rollout_id + 1 >= self.cfg.rollout.num_rollout:
            self._stop_producer()  # the run's last step: nothing more to generate
        return record

    def _producer_at(self, rollout_id: int) -> AsyncProducer:
        """The async loop, ready to hand out step `rollout_id`'s groups. One that is behind
        or ahead (another attempt's), failed, or on other engines is stopped: in the first
        two cases the loop restarts from the state the last generate committed; on new
        engines, or a router restarted on a new port, it goes on with every group it had."""
        p, router_url = self.producer, self.router_url()  # (restarts a router that died)
        if (p is not None and p.alive and p.next_step == rollout_id and p.urls == self.engine_urls
                and p.router_url == router_url):
            return p
        carried = p is not None and p.alive and p.next_step == rollout_id
        groups = self._stop_producer()
        if carried:
            self.data_source.buffer[:0] = groups
        else:
            self._restore_source(rollout_id)
        urls = list(self.engine_urls)
        workers = self.router.sync_workers if self.router is not None else None
        cfg, hooks, tokenizer = self.cfg, self.hooks, self.tokenizer
        producer = AsyncProducer(
            cfg, self.data_source, rollout_id,
            lambda: generation_session(cfg, urls, router_url, hooks, tokenizer, target=None,
                                       router_workers=workers),
            urls, router_url,
        )
        producer.start(required_weight_version(cfg, rollout_id))
        self.producer = producer
        return producer

    def _stop_producer(self) -> list[Group]:
        """Stop the async loop (if any); the groups it had, whole."""
        producer, self.producer = self.producer, None
        return producer.stop() if producer is not None else []

    def _step_source(self, rollout_id: int) -> StepDataSource:
        """The step's source as sample_prompts left it (the data source is already loaded
        from that stage's state)."""
        drawn = groups_in_order(
            read_samples(self.layout.store, step_dir(rollout_id), "prompts.arrow")
        )
        return StepDataSource(drawn, self.data_source, rollout_id)

    def _resume(
        self, rollout_id: int, source: StepDataSource, journal: GroupJournal
    ) -> tuple[StepDataSource, Restored | None, StepLog]:
        """Replay what an earlier attempt of this step committed to its journal, and the
        log this attempt appends to. A journal that does not replay (other settings, other
        draws) is removed and the step generated from the start, from a fresh source."""
        if not self.cfg.rollout.journal_groups:
            journal.clear()  # a stale one would be replayed once the switch is back on
            return source, None, NullLog()
        fingerprint = settings_fingerprint(self.cfg)
        entries = journal.entries()
        restored = None
        if entries:
            try:
                restored = replay(entries, source, fingerprint)
            except JournalMismatch as err:
                log.warning("step %d: not replaying its group journal (%s); generating the "
                            "step from the start", rollout_id, err)
                journal.clear()
                self.data_source.load(self.layout, rollout_id)
                source = self._step_source(rollout_id)
        next_seq = restored.next_seq if restored is not None else 0
        return source, restored, JournalLog(journal, fingerprint, next_seq)

    def _copy_debug_batch(self, rollout_id: int) -> GenerateRecord:
        source = self._debug_source_layout()
        if not source.store.exists(step_dir(rollout_id), "train.arrow"):
            raise FileNotFoundError(
                f"rollout.debug_rollout_data: {source.uri} has no "
                f"{step_dir(rollout_id)}/train.arrow"
            )
        samples = read_samples(source.store, step_dir(rollout_id), "train.arrow")
        uri = write_samples(self.layout.store, samples, step_dir(rollout_id), "rollout.arrow",
                            compression=self._compression())
        return GenerateRecord(uri=uri, groups=len(groups_in_order(samples)),
                              debug_train_only=True)

    def filter(self, rollout_id: int) -> FilterRecord:
        """Only trims the over-sampling: the over-sampling filter orders the generated groups,
        failed ones are dropped, and the first rollout_batch_size are kept (the dynamic filter
        ran during generation). Reads only rollout.arrow and writes nothing but its record,
        so re-running it is always safe."""
        groups = groups_in_order(
            read_samples(self.layout.store, step_dir(rollout_id), "rollout.arrow")
        )
        unfinished = [g[0].group_index for g in groups if not is_finished(g)]
        if unfinished:
            raise ValueError(f"step {rollout_id}: rollout.arrow holds unfinished groups "
                             f"{unfinished[:5]} (generate returns those to the buffer)")
        failed = [g for g in groups if any(s.status == Status.FAILED for s in g)]
        ok = [g for g in groups if g not in failed]
        if self.over_sampling_filter is not None and not self.cfg.rollout.debug_train_only:
            ok = returned_groups(self.over_sampling_filter, "rollout.over_sampling_filter_path",
                                 self.over_sampling_filter(self.cfg, ok))
        limit = len(ok) if self.cfg.rollout.debug_train_only else self.cfg.rollout.rollout_batch_size
        kept = ok[:limit]
        return FilterRecord(
            kept_groups=tuple(sorted(g[0].group_index for g in kept)),
            failed=len(failed),
            over_sampling_dropped=len(ok) - len(kept),
        )

    def reward(self, rollout_id: int, kept_groups: Sequence[int]) -> RewardRecord:
        """Computes no reward: generation did, as each group finished (the dynamic filter
        needs them then). This turns the kept groups' rewards into scalars
        (`rollout.reward_key`; a dict reward is kept in metadata), zeroes the loss mask of
        the samples `rollout.sample_filter_path` rejects, and writes them as train.arrow."""
        samples = read_samples(self.layout.store, step_dir(rollout_id), "rollout.arrow")
        keep = set(kept_groups)
        train = sorted((s for s in samples if s.group_index in keep), key=lambda s: s.index)
        rewards, removed = [], 0
        for s in train:
            if isinstance(s.reward, dict):
                s.metadata["reward_dict"] = s.reward
            s.reward = s.scalar_reward(self.cfg.rollout.reward_key)
            rewards.append(s.reward)
            if self.sample_filter is not None and not self.sample_filter(self.cfg, s):
                s.loss_mask = [0] * len(s.loss_mask)
                removed += 1
        uri = write_samples(
            self.layout.store,
            train,
            step_dir(rollout_id),
            "train.arrow",
            compression=self._compression(),
        )
        n = max(len(rewards), 1)
        mean = sum(rewards) / n
        return RewardRecord(
            uri=uri,
            samples=len(train),
            mean=mean,
            std=(sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
            removed=None if self.sample_filter is None else removed,
        )

    def evaluate(self, weight_version: int) -> dict[str, float]:
        metrics = asyncio.run(run_evaluation(
            self.cfg, self.engine_urls, self.router_url(), self.tokenizer, self.rewards,
            self.eval_fn, weight_version,
        ))
        self.layout.save_eval(weight_version, metrics)
        return metrics


def run_agent(r: RolloutConfig) -> AgentFn | None:
    """The agent each sample runs through the gateway: the environment's episode
    (`rollout.environment`) or the user's agent (`rollout.agent_path`)."""
    if r.environment:
        return environment_agent(r.environment)
    return load_hook(r.agent_path, "rollout.agent_path", AgentFn) if r.agent_path else None
