"""The record that crosses every stage boundary: one response to one prompt.

A *group* is the `n_samples_per_prompt` samples of one prompt; groups move together and are
never split across steps (`Group` is simply `list[Sample]`).
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

ChatMessages = list[dict[str, Any]]
Prompt = str | ChatMessages


class RewardError(ValueError):
    """A reward that cannot be trained on: missing where one is needed, or not a finite
    number. Raised, never scored as zero: one NaN reward turns every weight into NaN a step
    later, and the hook that returned it has to be fixed (rerunning the step then regenerates
    it, since nothing non-finite was stored)."""


class Status(StrEnum):
    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, eq=False)
class RoutedExperts:
    """An MoE model's routing of one sample, as the engine ran it (SGLang's
    `meta_info["routed_experts"]`): for each token of `tokens[:-1]` (the last token is
    never fed to the model), each decoder layer's top-k expert ids, flattened
    `[tokens, layers, topk]`, -1 for a layer without a router. int16, not SGLang's int32:
    expert ids stay below 32768, and a response of 4k tokens on a 48-layer top-8 model is
    1.5M ids. The trainer replays them (`algorithm.routing_replay`)."""

    ids: np.ndarray  # int16, 1-D

    @classmethod
    def of(cls, ids: Any) -> RoutedExperts:
        array = np.asarray(ids)
        if array.size and (array.min() < -1 or array.max() > np.iinfo(np.int16).max):
            raise ValueError(f"routed expert ids must be in [-1, 32767], got {array.min()} "
                             f"to {array.max()}")
        return cls(np.ascontiguousarray(array.astype(np.int16, copy=False).reshape(-1)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoutedExperts) and np.array_equal(self.ids, other.ids)

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return int(self.ids.size)

    def per_token(self, tokens: int, layers: int, topk: int, where: str) -> np.ndarray:
        """`[tokens, layers, topk]`; a clear error naming `where` if the count differs."""
        if self.ids.size != tokens * layers * topk:
            raise ValueError(
                f"{where}: routed_experts has {self.ids.size} ids, not {tokens} tokens x "
                f"{layers} layers x top-{topk} = {tokens * layers * topk} (the engine's model "
                "must be the trainer's, and cover every token but the last)"
            )
        return self.ids.reshape(tokens, layers, topk)


@dataclass(slots=True)
class Sample:
    """One response to one prompt, in slime's shape.

    `tokens` holds prompt + response ids; `loss_mask` and `rollout_log_probs` cover only the
    response (`response_length` entries). `reward` is a float or, for reward models that
    return several scores, a dict from which `reward_key` picks the trained one.
    `routed_experts` (MoE models, when the rollout asks the engine for them) covers every
    token but the last, prompt included. `token_versions` holds the weight version that
    generated each response token, read through `response_versions()` (a custom generate
    function may not record them).
    """

    index: int
    group_index: int
    prompt: Prompt = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, float] | None = None
    loss_mask: list[int] = field(default_factory=list)
    rollout_log_probs: list[float] = field(default_factory=list)
    status: Status = Status.PENDING
    weight_version: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    routed_experts: RoutedExperts | None = None
    token_versions: list[int] = field(default_factory=list)

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    @property
    def prompt_tokens(self) -> list[int]:
        return self.tokens[: self.prompt_length]

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_length :]

    def describe(self) -> str:
        """How errors name this sample: its index and the dataset line of its prompt."""
        line, file = self.metadata.get("source_line"), self.metadata.get("source_file")
        where = f"prompt line {line}" + (f" of {file}" if file else "")
        return f"sample {self.index}" + (f" ({where})" if line is not None else "")

    def check_reward(self, source: str | None = None) -> None:
        """Raise `RewardError` if the reward is NaN, inf or not a number, or a dict reward
        has a number that is not finite; `source` names the reward function. A sample not
        scored yet (None) passes: only `scalar_reward` needs one."""
        if self.reward is None:
            return
        items = self.reward.items() if isinstance(self.reward, dict) else [("", self.reward)]
        for key, value in items:
            is_number = isinstance(value, numbers.Real)
            if key and not is_number:
                continue  # a side field of a reward model's answer; never trained on
            if is_number and math.isfinite(value):
                continue
            by = source or self.metadata.get("rm_type") or (
                "the reward function (rollout.custom_rm_path or rollout.rm_type)"
            )
            what = f"reward[{key!r}]" if key else "reward"
            raise RewardError(
                f"{self.describe()}: {what} is {value!r}, not a finite number; returned by {by}"
            )

    def scalar_reward(self, reward_key: str | None = None) -> float:
        """The reward the algorithm trains on; a dict reward needs `reward_key`."""
        if self.reward is None:
            raise RewardError(f"{self.describe()}: reward is missing")
        self.check_reward()
        if isinstance(self.reward, dict):
            if reward_key is None or reward_key not in self.reward:
                raise KeyError(
                    f"sample {self.index}: reward is a dict with keys {sorted(self.reward)}; "
                    f"set rollout.reward_key to one of them (got {reward_key!r})"
                )
            return float(self.reward[reward_key])
        return float(self.reward)

    def append_response(self, token_ids: list[int], log_probs: list[float], text: str,
                        versions: list[int] | None = None) -> None:
        """Extend the response with freshly generated tokens (used by partial rollouts too);
        `versions`: the weight version of each (UNKNOWN_VERSION for each where not given)."""
        self.tokens.extend(token_ids)
        self.response += text
        self.response_length += len(token_ids)
        self.loss_mask.extend([1] * len(token_ids))
        self.rollout_log_probs.extend(log_probs)
        self.token_versions.extend(versions if versions is not None
                                   else [UNKNOWN_VERSION] * len(token_ids))

    def response_versions(self) -> list[int]:
        """The weight version of each response token. A token whose version was not recorded
        (UNKNOWN_VERSION, or all of them where a custom generate function built the response
        itself and the list does not line up) counts as coming from the oldest version the
        sample knows: its staleness is never under-counted."""
        oldest = int(self.metadata.get("start_weight_version", self.weight_version))
        versions = self.token_versions
        if len(versions) != self.response_length:
            return [oldest] * self.response_length
        return [oldest if v == UNKNOWN_VERSION else v for v in versions]

    def check(self) -> None:
        """Raise if the per-token fields disagree with `response_length`."""
        n = self.response_length
        if n > len(self.tokens):
            raise ValueError(f"sample {self.index}: response_length {n} > len(tokens)")
        if len(self.loss_mask) != n:
            raise ValueError(
                f"sample {self.index}: loss_mask has {len(self.loss_mask)} entries, "
                f"response_length is {n}"
            )
        if self.rollout_log_probs and len(self.rollout_log_probs) != n:
            raise ValueError(
                f"sample {self.index}: rollout_log_probs has {len(self.rollout_log_probs)} "
                f"entries, response_length is {n}"
            )

    def clone(self) -> Sample:
        """An independent copy, as `copy.deepcopy` makes it, but faster (a data source makes
        n_samples_per_prompt clones per prompt; bench/RESULTS.md, "Train step"): the id lists
        are copied as lists and only the fields that may nest (chat prompt, dict reward,
        metadata) go through deepcopy."""
        return Sample(
            index=self.index,
            group_index=self.group_index,
            prompt=self.prompt if isinstance(self.prompt, str) else copy.deepcopy(self.prompt),
            tokens=list(self.tokens),
            response=self.response,
            response_length=self.response_length,
            label=self.label,
            reward=copy.deepcopy(self.reward) if isinstance(self.reward, dict) else self.reward,
            loss_mask=list(self.loss_mask),
            rollout_log_probs=list(self.rollout_log_probs),
            status=self.status,
            weight_version=self.weight_version,
            metadata=copy.deepcopy(self.metadata) if self.metadata else {},
            routed_experts=self.routed_experts,  # immutable
            token_versions=list(self.token_versions),
        )


Group = list[Sample]

UNKNOWN_VERSION = -1
"""A response token whose generating weight version was not recorded."""
VERSION_SPANS = "weight_versions"
"""The `/generate` answer's `meta_info` key, as SGLang writes it, for the weight versions of
the output tokens: `[{"version": "3", "start": 0, "end": 17}, {"version": "4", "start": 17,
"end": 40}]`, a span per run of tokens one version generated (a weight update landed
mid-request where there are several). Older SGLang servers report only `weight_version`."""


def versions_from_spans(spans: Any, length: int, version: int) -> list[int]:
    """Per-token versions of a response of `length` tokens from its `weight_versions` spans;
    without spans every token is `version`'s (the one the answer reports). A version that is
    not a number (SGLang's "default", the weights it started with) is 0."""
    out = [version] * length
    for span in spans or []:
        start, end = max(0, int(span["start"])), min(length, int(span["end"]))
        out[start:end] = [version_number(span["version"])] * max(0, end - start)
    return out


def version_number(value: Any) -> int:
    """A weight version as SGLang reports it (a string; "default" for the weights it started
    with, 0 here)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def flatten(groups: list[Group]) -> list[Sample]:
    return [s for g in groups for s in g]


def regroup(samples: list[Sample]) -> list[Group]:
    """Split samples (sorted or not) back into groups, ordered by group index."""
    by_group: dict[int, Group] = {}
    for s in sorted(samples, key=lambda s: s.index):
        by_group.setdefault(s.group_index, []).append(s)
    return [by_group[k] for k in sorted(by_group)]
