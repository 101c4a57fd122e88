"""Which reward function scores which sample (slime's `async_rm` / `batched_async_rm`).

```
 rollout.custom_rm_path ─┐  (group_rm: one call per group, `async (args, samples) -> list`)
 rollout.rm_type ────────┼──► default ──┐
 sample.metadata.rm_type ─────────────── ├─► reward (float or dict; reward_key picks one later)
                                        ┘
 "boxed_<rule>": score only the last \\boxed{...} of the response with <rule>
```
Built-ins live in `RULES` (pure `(response, label) -> reward`), `SAMPLE_REWARDS` (graded by
the sample's metadata: `reasoning_gym`, the task's own scorer), `remote_rm`, which needs
`rollout.rm_url`, and `judge`, an LLM judge that needs `rollout.judge` (rewards/judge.py).
Names are resolved once and cached; an unknown name fails with the config key (or sample)
that named it.

Rules that can hang (the math-verify ones: sympy on an adversarial answer) are graded in worker
processes with a deadline, `rollout.rm_rule_timeout_s` (`engines.rollout.rewards.deadline`); past it the
sample gets the rule's failure value and is counted. `IN_PROCESS` rules stay in the actor:
they are linear scans (split, lower, Counter, and regexes without nested repetition) of a
response bounded by max_response_len, so they cannot hang, and a process hop would only cost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from engines.config.rollout import RolloutConfig
from engines.config.sandbox import SandboxConfig
from engines.hooks.loader import bad_return, load_user_hook
from engines.hooks.protocols import GroupRewardFn, Reward, RewardFn
from engines.rollout.rewards.code_tests import code_tests_reward
from engines.rollout.rewards.deadline import (
    DEFAULT_TIMEOUT_S,
    SHARED_POOL,
    TIMEOUT_FLAG,
    GradingPool,
)
from engines.rollout.rewards.judge import JudgeReward
from engines.rollout.rewards.math_rules import dapo_score, deepscaler_score, last_boxed, math_score
from engines.rollout.rewards.reasoning_gym import reasoning_gym_reward
from engines.rollout.rewards.remote import RemoteRewardModel
from engines.rollout.rewards.text_rules import exact_match_score, f1_score, last_number_score
from storage.sample import RewardError, Sample

log = logging.getLogger(__name__)
RuleFn = Callable[[str, str | None], Reward]

RULES: dict[str, RuleFn] = {
    "math": math_score,
    "deepscaler": deepscaler_score,
    "dapo": dapo_score,
    "f1": f1_score,
    "exact_match": exact_match_score,
    "last_number": last_number_score,
}
IN_PROCESS: frozenset[RuleFn] = frozenset({f1_score, exact_match_score, last_number_score})
SAMPLE_REWARDS: dict[str, Callable[[float], RewardFn]] = {
    "reasoning_gym": reasoning_gym_reward,
}
"""Built-ins that grade a sample by more than its label (its metadata), from the grading
deadline to the reward function."""
BOXED_PREFIX = "boxed_"
REMOTE = "remote_rm"
JUDGE = "judge"  # an LLM judge behind an OpenAI-compatible API (rollout.judge)
CODE_TESTS = "code_tests"  # the model's program against the label's tests, sandboxed


class RewardConfigError(ValueError):
    pass


def compares_with_label(name: str) -> bool:
    """Whether the built-in `name` scores a response against the sample's label (the rules:
    without a label every response gets the rule's failure value, and nothing is learnt)."""
    return name.removeprefix(BOXED_PREFIX) in RULES


def rule_reward(
    rule: RuleFn,
    boxed: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pool: GradingPool | None = None,
) -> RewardFn:
    """A rule as a reward function; `boxed` first cuts the response down to its last box
    (no box: the empty string, which no rule rewards). Rules outside `IN_PROCESS` run in
    `pool` (default: the process's) with a `timeout_s` deadline; a timeout scores
    `rule("", None)`, the rule's failure value (0.0; dapo's -1), and flags the sample."""
    isolated = rule not in IN_PROCESS
    grading = pool or SHARED_POOL

    async def reward(args: Any, sample: Sample, /) -> Reward:
        response = (last_boxed(sample.response) or "") if boxed else sample.response
        if not isolated:
            return rule(response, sample.label)
        score = await grading.grade(rule, response, sample.label, timeout_s)
        if score is None:
            log.warning("sample %d: %s took over %.3g s to grade; scored as a failure",
                        sample.index, reward.__qualname__, timeout_s)
            sample.metadata[TIMEOUT_FLAG] = True
            return rule("", None)
        sample.metadata.pop(TIMEOUT_FLAG, None)
        return score

    reward.__qualname__ = f"{BOXED_PREFIX if boxed else ''}{getattr(rule, '__name__', 'rule')}"
    return reward


REWARD_FUNCTIONS: dict[str, RewardFn] = {name: rule_reward(fn) for name, fn in RULES.items()}


def builtin_reward(
    name: str,
    where: str,
    remote: RemoteRewardModel | None = None,
    rule_timeout_s: float = DEFAULT_TIMEOUT_S,
    sandbox: SandboxConfig | None = None,
    judge: JudgeReward | None = None,
) -> RewardFn:
    """The built-in called `name` (`boxed_` prefix allowed); `where` names the config key or
    sample in errors."""
    boxed = name.startswith(BOXED_PREFIX)
    base = name[len(BOXED_PREFIX) :] if boxed else name
    if boxed and base in (CODE_TESTS, JUDGE, REMOTE, *SAMPLE_REWARDS):
        raise RewardConfigError(f"{where}: the boxed_ prefix applies to rule rewards only")
    if base == CODE_TESTS:
        return code_tests_reward(sandbox)
    if base == JUDGE:
        if judge is None:
            raise RewardConfigError(f"{where}: judge needs rollout.judge (base_url, model)")
        return judge.score
    if base == REMOTE:
        if remote is None:
            raise RewardConfigError(f"{where}: remote_rm needs rollout.rm_url")
        return remote.score
    if base in SAMPLE_REWARDS:
        return SAMPLE_REWARDS[base](rule_timeout_s)
    if base not in RULES:
        raise RewardConfigError(
            f"{where}: unknown reward {name!r}; built-ins: "
            f"{sorted([*RULES, *SAMPLE_REWARDS, REMOTE, CODE_TESTS, JUDGE])} (rules also as "
            f"{BOXED_PREFIX}<rule>)"
        )
    return rule_reward(RULES[base], boxed, rule_timeout_s)


class RewardHub:
    """Scores samples and groups for one run; built from the rollout section only."""

    def __init__(
        self,
        default: RewardFn | None = None,
        group_fn: GroupRewardFn | None = None,
        remote: RemoteRewardModel | None = None,
        rule_timeout_s: float = DEFAULT_TIMEOUT_S,
        sandbox: SandboxConfig | None = None,
        judge: JudgeReward | None = None,
    ) -> None:
        self.default = default
        self.group_fn = group_fn
        self.remote = remote
        self.rule_timeout_s = rule_timeout_s
        self.sandbox = sandbox
        self.judge = judge
        self._by_type: dict[str, RewardFn] = {}

    @classmethod
    def from_config(cls, cfg: RolloutConfig) -> RewardHub:
        remote = (
            RemoteRewardModel(
                cfg.rm_url, cfg.rm_timeout_s, cfg.rm_max_retries, cfg.rm_backoff_s
            )
            if cfg.rm_url
            else None
        )
        judge = JudgeReward.from_config(cfg.judge) if cfg.judge else None
        if cfg.group_rm and not cfg.custom_rm_path:
            raise RewardConfigError(
                "rollout.group_rm: needs rollout.custom_rm_path, a batched reward function "
                "`async (args, samples) -> list[reward]`"
            )
        if cfg.custom_rm_path:
            protocol = GroupRewardFn if cfg.group_rm else RewardFn
            fn = load_user_hook(cfg.custom_rm_path, "rollout.custom_rm_path", protocol)
            return cls(None if cfg.group_rm else fn, fn if cfg.group_rm else None, remote,
                       cfg.rm_rule_timeout_s, cfg.sandbox, judge)
        default = (
            builtin_reward(cfg.rm_type, "rollout.rm_type", remote, cfg.rm_rule_timeout_s,
                           cfg.sandbox, judge)
            if cfg.rm_type
            else None
        )
        return cls(default, None, remote, cfg.rm_rule_timeout_s, cfg.sandbox, judge)

    @property
    def configured(self) -> bool:
        """False when the run names no reward (samples may still carry metadata.rm_type)."""
        return self.default is not None or self.group_fn is not None

    def for_sample(self, sample: Sample) -> RewardFn:
        rm_type = sample.metadata.get("rm_type")
        if rm_type:
            if rm_type not in self._by_type:
                where = f"sample {sample.index} (line {sample.metadata.get('source_line')}) metadata.rm_type"
                self._by_type[rm_type] = builtin_reward(
                    str(rm_type), where, self.remote, self.rule_timeout_s, self.sandbox,
                    self.judge,
                )
            return self._by_type[rm_type]
        if self.default is None:
            raise RewardConfigError(
                f"sample {sample.index}: no reward function (set rollout.rm_type, "
                f"rollout.custom_rm_path or metadata.rm_type)"
            )
        return self.default

    async def score(self, args: Any, sample: Sample) -> Reward:
        return await self.for_sample(sample)(args, sample)

    async def score_group(self, args: Any, samples: Sequence[Sample]) -> list[Reward]:
        """One reward per sample, in order: a single call of the group reward model when
        `group_rm` is on, else the per-sample functions concurrently."""
        if self.group_fn is not None:
            try:
                result = await self.group_fn(args, list(samples))
            except Exception as e:  # most often a per-sample function under group_rm
                e.add_note("rollout.group_rm=true calls rollout.custom_rm_path once per group, "
                           "with the list of its samples")
                raise
            try:
                rewards = list(result)
            except TypeError:  # a per-sample reward function under group_rm, most often
                raise bad_return(self.group_fn, "rollout.custom_rm_path", result,
                                 "a list of one reward per sample (rollout.group_rm=true)"
                                 ) from None
            if len(rewards) != len(samples):
                raise RewardConfigError(
                    f"rollout.custom_rm_path: group reward returned {len(rewards)} rewards "
                    f"for {len(samples)} samples"
                )
            return rewards
        return list(await asyncio.gather(*(self.score(args, s) for s in samples)))

    async def assign(self, args: Any, samples: Sequence[Sample]) -> None:
        """Score and store `sample.reward` for every sample; a NaN/inf reward fails here,
        naming the function, before a filter or the trainer sees it."""
        for s, r in zip(samples, await self.score_group(args, samples), strict=True):
            s.reward = r
            fn = self.group_fn if self.group_fn is not None else self.for_sample(s)
            source = getattr(fn, "__qualname__", None) or repr(fn)
            if r is None:  # not trainable; say which function, as for NaN
                raise RewardError(f"{s.describe()}: reward is None; returned by {source} (it "
                                  "must return a number, or a dict with rollout.reward_key)")
            s.check_reward(source=source)
