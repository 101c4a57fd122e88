"""The example's second held-out figure: the share of functions whose every test passes.

`rollout.sandbox.reward` is one setting for the whole run, and the run trains on the share
of tests passed; run.py adds a copy of the held-out set scored by this reward instead
(`eval.datasets[].custom_rm_path`), with grpo.yaml's sandbox limits.
"""

from __future__ import annotations

from engines.config.sandbox import SandboxConfig
from engines.hooks.protocols import RewardFn
from engines.rollout.rewards.code_tests import code_tests_reward

all_pass: RewardFn = code_tests_reward(SandboxConfig(reward="all_pass", wall_s=5, cpu_s=2))
