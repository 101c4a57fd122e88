"""`rollout.rm_type: reasoning_gym`: a response graded by its task's own `score_answer`.

The prompt set is a `reasoning_gym://` URI (`engines.data.reasoning_gym`); each sample's
metadata holds that URI and the generated entry, so the grader is the task's dataset built
from the same URI and the entry is the one the prompt came from.

Which part of the response is the answer, in order:

* the last `<answer>...</answer>`, as reasoning-gym's own `extract_answer` finds it (its
  prompts ask for those tags);
* after an `<answer>` that is never closed: what follows it (a response stopped by a
  `</answer>` stop string, or cut at max_response_len);
* no tags at all: the whole response, stripped (a model trained to answer directly, like the
  example's character-level model, whose vocabulary has no `<` or `>`).

The task's scorer decides the rest (partial credit, tolerated formats). Scorers can be slow
on adversarial answers (some parse with sympy), so grading runs in the grading pool's worker
processes with `rollout.rm_rule_timeout_s`, as the math rules do; past it the sample scores 0
and is counted (`engines.rollout.rewards.deadline`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from engines.data.reasoning_gym import ENTRY_KEY, task_dataset
from engines.hooks.protocols import Reward, RewardFn
from engines.rollout.rewards.deadline import (
    DEFAULT_TIMEOUT_S,
    SHARED_POOL,
    TIMEOUT_FLAG,
    GradingPool,
)
from storage.sample import RewardError, Sample

log = logging.getLogger(__name__)
_OPEN = "<answer>"


def final_answer(response: str) -> str:
    """The part of `response` the task's scorer grades (see the module docstring)."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(response)
    if tagged is not None:
        return tagged
    if _OPEN in response:
        return response.rsplit(_OPEN, 1)[1].strip()
    return response.strip()


def score_entry(uri: str, entry: dict[str, Any], response: str, label: str | None = None) -> float:
    """`response` graded against `entry` by the scorer of the task `uri` names. A module
    function, so the grading pool's workers can run it; `label` is unused (the entry holds
    the answer) and is there because the pool calls `rule(response, label)`."""
    return float(task_dataset(uri).score_answer(final_answer(response), entry))


def stored_entry(sample: Sample) -> tuple[str, dict[str, Any]]:
    """(uri, entry) the sample's prompt came from; RewardError when it has none."""
    stored = sample.metadata.get(ENTRY_KEY)
    if not (isinstance(stored, dict) and isinstance(stored.get("uri"), str)
            and isinstance(stored.get("entry"), dict)):
        raise RewardError(
            f"{sample.describe()}: rm_type reasoning_gym grades prompts of a "
            f"reasoning_gym://<task>?seed=S prompt set, whose metadata holds the task's entry "
            f"(metadata.{ENTRY_KEY}); this sample has none (is data.prompt_data, or the eval "
            "set's path, a reasoning_gym:// URI, and its metadata_key set?)"
        )
    return stored["uri"], stored["entry"]


Scorer = Callable[[str, dict[str, Any], str, str | None], float]
"""(uri, entry, response, label) -> score: `score_entry`, or a module-level stand-in."""


def reasoning_gym_reward(timeout_s: float = DEFAULT_TIMEOUT_S, pool: GradingPool | None = None,
                         scorer: Scorer = score_entry) -> RewardFn:
    """The reward function; `scorer` runs in `pool` (default: the process's) within
    `timeout_s`."""
    grading = pool or SHARED_POOL

    async def reasoning_gym(args: Any, sample: Sample, /) -> Reward:
        uri, entry = stored_entry(sample)
        score = await grading.grade(partial(scorer, uri, entry), sample.response,
                                    sample.label, timeout_s)
        if score is None:
            log.warning("sample %d: reasoning_gym took over %.3g s to grade; scored 0",
                        sample.index, timeout_s)
            sample.metadata[TIMEOUT_FLAG] = True
            return 0.0
        sample.metadata.pop(TIMEOUT_FLAG, None)
        return float(score)

    return reasoning_gym
