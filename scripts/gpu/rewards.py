"""A reward a random model can earn, so the GPU end-to-end parts train something.

Exact-match arithmetic gives a random Qwen2-0.5B-shaped model reward 0 on every sample:
every GRPO group has zero advantage and a "train step" computes nothing. The share of even
token ids in the response differs from sample to sample (about 0.5 ± 0.1 for 32 random
tokens), so every group has non-zero advantages, and the policy can move it.
"""

from __future__ import annotations

from typing import Any


def even_token_share(response_tokens: list[int]) -> float:
    return sum(1 for t in response_tokens if t % 2 == 0) / max(len(response_tokens), 1)


async def even_tokens(args: Any, sample: Any) -> float:
    """rollout.custom_rm_path=scripts.gpu.rewards:even_tokens"""
    return even_token_share(sample.response_tokens)
