"""The reward hub: built-in rule rewards, remote reward models and user reward hooks."""

from engines.rollout.rewards.hub import (
    BOXED_PREFIX,
    REWARD_FUNCTIONS,
    RULES,
    RewardConfigError,
    RewardHub,
    builtin_reward,
    rule_reward,
)
from engines.rollout.rewards.math_rules import (
    answers_match,
    dapo_score,
    deepscaler_score,
    last_boxed,
    math_score,
)
from engines.rollout.rewards.remote import RemoteRewardError, RemoteRewardModel
from engines.rollout.rewards.text_rules import exact_match_score, f1_score, last_number_score

__all__ = [
    "BOXED_PREFIX",
    "REWARD_FUNCTIONS",
    "RULES",
    "RemoteRewardError",
    "RemoteRewardModel",
    "RewardConfigError",
    "RewardHub",
    "answers_match",
    "builtin_reward",
    "dapo_score",
    "deepscaler_score",
    "exact_match_score",
    "f1_score",
    "last_boxed",
    "last_number_score",
    "math_score",
    "rule_reward",
]
