"""`remote_rm`: a reward model behind HTTP (slime's remote_rm), with timeouts and retries.

POST `{"prompt", "response", "label", "metadata"}` as JSON to `rollout.rm_url`; the answer is
a number, or an object of numbers (a dict reward; `rollout.reward_key` picks one). Transport
errors, timeouts, 429 and 5xx are retried with exponential backoff (the server is probably
busy or restarting); any other 4xx fails at once, because repeating a bad request cannot help.
"""

from __future__ import annotations

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Any

import httpx

from engines.process import tls_verify
from storage.sample import Sample

logger = logging.getLogger(__name__)

Reward = float | dict[str, float]


class RemoteRewardError(RuntimeError):
    pass


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Delay before retry `attempt` (0-based): base * 2**attempt, capped, plus <=10% jitter
    so that many samples failing together do not retry in lockstep."""
    delay = min(base_s * (2**attempt), max_s)
    return delay + random.uniform(0.0, 0.1 * delay)


def _is_retryable(status: int) -> bool:
    return status == 429 or status >= 500


def parse_reward(body: Any, url: str) -> Reward:
    if isinstance(body, bool) or not isinstance(body, int | float | dict):
        raise RemoteRewardError(
            f"rollout.rm_url {url}: expected a number or an object of numbers, got {body!r}"
        )
    if isinstance(body, dict):
        try:
            return {str(k): float(v) for k, v in body.items()}
        except (TypeError, ValueError):
            raise RemoteRewardError(
                f"rollout.rm_url {url}: reward object has non-numeric values: {body!r}"
            ) from None
    return float(body)


@dataclass(frozen=True, slots=True)
class RemoteRewardModel:
    url: str
    timeout_s: float = 30.0
    max_retries: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def payload(self, sample: Sample) -> dict[str, Any]:
        return {
            "prompt": sample.prompt,
            "response": sample.response,
            "label": sample.label,
            "metadata": sample.metadata,
        }

    async def score(self, args: Any, sample: Sample, /) -> Reward:
        """A reward function (`RewardFn`): one POST per sample, retried as described above.

        A client per call: an httpx client is bound to the event loop it was made on, and the
        rollout manager runs a fresh loop every step."""
        last_error: Exception | None = None
        async with httpx.AsyncClient(timeout=self.timeout_s, verify=tls_verify(self.url)) as client:
            for attempt in range(self.max_retries + 1):
                if attempt:
                    await asyncio.sleep(backoff_delay(attempt - 1, self.backoff_s, self.max_backoff_s))
                try:
                    response = await client.post(self.url, json=self.payload(sample))
                except httpx.TransportError as e:  # connect/read errors and timeouts
                    last_error = e
                    logger.info("remote_rm %s: %r (attempt %d)", self.url, e, attempt + 1)
                    continue
                if response.status_code < 400:
                    return parse_reward(response.json(), self.url)
                last_error = RemoteRewardError(
                    f"rollout.rm_url {self.url}: HTTP {response.status_code}: "
                    f"{response.text.strip()[:200]}"
                )
                if not _is_retryable(response.status_code):
                    raise last_error
        raise RemoteRewardError(
            f"rollout.rm_url {self.url}: sample {sample.index} failed after "
            f"{self.max_retries + 1} attempts: {last_error!r}"
        )
