"""What one step's generation is made of as it runs: the loop's tallies (`LoopTally`), where
each group it is done with goes (`StepGroups`), and the statistics and metrics of the
groups it produced (`GenerationStats`). The generation loop (engines/rollout/generation.py)
fills them; `RolloutResult` there is built from them.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from engines.rollout.agent_gateway import AGENT_COUNTERS
from engines.rollout.restore import Outcome, Restored
from engines.rollout.rewards.judge import count_judge_errors
from storage.sample import Group, Sample, Status


def first_index(group: Group) -> int:
    return group[0].index


def reset_to_prompt(sample: Sample) -> None:
    """Forget a sample's response (a recycled group without partial rollout)."""
    del sample.tokens[sample.prompt_length :]
    sample.response, sample.response_length = "", 0
    sample.loss_mask, sample.rollout_log_probs, sample.token_versions = [], [], []
    sample.routed_experts = None
    sample.status, sample.reward, sample.weight_version = Status.PENDING, None, 0
    sample.metadata.pop("start_weight_version", None)


@dataclass
class LoopTally:
    """What the loop counts as it goes, over every group it sends or scores, kept or not."""

    generated_tokens: int = 0
    group_tokens: Counter[int] = field(default_factory=Counter)  # generated_tokens by group_index
    resumed_samples: int = 0  # partial samples continued
    stale_regenerated: int = 0  # started over: begun on a policy older than allowed
    stale_dropped: int = 0  # groups not trained: begun on a policy older than allowed
    reward_timeouts: int = 0  # every group scored, kept or not: each one stalled the step
    judge_failures: int = 0  # samples the judge scored 0, unreachable (on_failure: zero)
    judge_unparsed: int = 0  # samples the judge scored 0, its answer held no score
    judge_retries: int = 0  # requests sent again after the judge gave no answer

    def generated(self, sample: Sample, tokens: int) -> None:
        self.generated_tokens += tokens
        self.group_tokens[sample.group_index] += tokens

    def judged(self, group: Group) -> None:
        failed, unparsed, retried = count_judge_errors(group)
        self.judge_failures += failed
        self.judge_unparsed += unparsed
        self.judge_retries += retried


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
    judge_failures: int = 0  # samples scored 0 by rollout.judge.on_failure: zero, by kind
    judge_unparsed: int = 0
    judge_retries: int = 0
    tokens_restored: int = 0  # held by groups an earlier attempt committed
    tokens_regenerated: int = 0  # for groups an earlier attempt or a lost engine had in flight
    journal: dict[str, float] = field(default_factory=dict)
    response_lengths: list[int] = field(default_factory=list)
    agent: Counter[str] = field(default_factory=Counter)  # AGENT_COUNTERS summed over samples

    @classmethod
    def of(
        cls, groups: list[Group], tally: LoopTally, seconds: float, *, abort_seconds: float = 0.0,
        tokens_restored: int = 0, tokens_regenerated: int = 0,
        journal: dict[str, float] | None = None,
    ) -> GenerationStats:
        """Samples, lengths and statuses of `groups` (what the caller keeps); tokens and
        reward timeouts of every group the loop generated or scored."""
        stats = cls(seconds=seconds, abort_seconds=abort_seconds,
                    generated_tokens=tally.generated_tokens, reward_timeouts=tally.reward_timeouts,
                    judge_failures=tally.judge_failures, judge_unparsed=tally.judge_unparsed,
                    judge_retries=tally.judge_retries,
                    tokens_restored=tokens_restored, tokens_regenerated=tokens_regenerated,
                    journal=journal or {})
        stats.add_groups(groups)
        return stats

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
            "rollout/judge_failures": float(self.judge_failures),
            "rollout/judge_unparsed": float(self.judge_unparsed),
            "rollout/judge_retries": float(self.judge_retries),
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
class StepGroups:
    """Where each group a step is done with goes: `kept` is trained, `returned` goes back to
    the buffer whole, `surplus` (kept beyond the target) joins it; the rest is only counted."""

    kept: list[Group] = field(default_factory=list)
    returned: list[Group] = field(default_factory=list)
    surplus: list[Group] = field(default_factory=list)
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("drawn", "dropped", "failed", "aborted", "surplus"), 0))
    first_failure: str | None = None  # why the first failed group failed, for the step's error

    @classmethod
    def restored(cls, r: Restored) -> StepGroups:
        """What an earlier attempt of the step had done in its loop (its drain comes later)."""
        groups = cls(list(r.kept), list(r.returned))
        groups.counts.update(r.counts, drawn=r.drawn)
        return groups

    def add(self, group: Group, outcome: Outcome) -> None:
        if outcome == Outcome.KEPT:
            self.kept.append(group)
        elif outcome == Outcome.SURPLUS:
            self.surplus.append(group)
        elif outcome == Outcome.RETURNED:  # aborted by someone else: keep the work
            self.returned.append(group)
        else:
            self.counts[outcome] += 1
            if outcome == Outcome.FAILED and self.first_failure is None:
                self.first_failure = failure_reason(group)
            if outcome == Outcome.ABORTED:  # partial tokens, kept for the next step
                self.returned.append(group)

    def trim(self, target: int) -> None:
        """Keep the first `target` groups by index; the rest are surplus."""
        self.kept.sort(key=first_index)
        self.surplus.extend(self.kept[target:])
        del self.kept[target:]

    def settle(self, partial_rollout: bool) -> None:
        """Surplus goes back with the returned groups, which keep their tokens only for
        partial rollouts."""
        self.counts["surplus"] = len(self.surplus)
        self.returned.extend(self.surplus)
        if not partial_rollout:
            for s in (s for g in self.returned for s in g):
                reset_to_prompt(s)
        self.returned.sort(key=first_index)


def failure_reason(group: Group) -> str:
    """The first failed sample of `group`, and why: its agent's (or environment's) error, or
    an engine answer with no finish reason rollflow knows."""
    failed = next(s for s in group if s.status == Status.FAILED)
    why = failed.metadata.get("agent_error") or "the engine's answer had no known finish reason"
    return f"{failed.describe()}: {why}"
