"""`rm_type: judge`: an LLM grades each response through any OpenAI-compatible API.

```
 sample ─► fill rollout.judge.template ─► cache hit? ──yes──────────────────► reward
           ({prompt} {response} {label})      │ no                              ▲
                                              ▼                                 │
            ≤ max_concurrency in flight ─► POST {base_url}/chat/completions     │
            (timeouts, 429, 5xx: retried      │ answer text                     │
             with remote_rm's backoff)        ▼                                 │
                               score_pattern ─► score in [min, max] ─► (score - min) / (max - min)
```
A failure is never a silent 0. A judge still unreachable after `max_retries`, or an answer
with no score in range ("unparsed"), is handled by `on_failure`: `retry_then_fail` re-asks an
unparsed answer too, then fails the step; `fail` fails it at once; `zero` scores 0, writes
the reason to `metadata.judge_error` and the loop counts it (`rollout/judge_failures`,
`rollout/judge_unparsed`). A judge that refuses the request itself (401, 403, 404: a wrong key,
model or URL) fails the step in every mode: it would refuse every sample. The error names the
judge URL, the sample and the reason, with the answer cut to 200 characters.

The cache keys a score by the request it answered (model, messages, max_tokens, ...). It is
used at temperature 0 only: a greedy judge answers a repeated request the same way, so a hit
returns exactly what a new request would, without its cost (a group of identical responses is
judged once). Above 0 each request is a fresh draw, which a cache would freeze.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from engines.config.judge import PLACEHOLDERS, JudgeConfig
from engines.process import tls_verify
from engines.rollout.rewards.remote import backoff_delay
from storage.sample import Prompt, Sample
from storage.secrets import redact_url

log = logging.getLogger(__name__)

JUDGE_ERROR = "judge_error"
"""`sample.metadata` key of a sample the judge scored 0 (`on_failure: zero`): `"<kind>:
<reason>"`, kind `failed` or `unparsed`; cleared when the sample is judged."""
JUDGE_RETRIES = "judge_retries"
"""`sample.metadata` key: requests for this sample sent again after the judge gave no answer."""
FAILED, UNPARSED = "failed", "unparsed"
ANSWER_CHARS = 200  # of a judge's answer quoted in an error
MAX_BACKOFF_S = 30.0
REFUSED = frozenset({401, 403, 404})  # the request itself is wrong: every sample would fail
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


class JudgeError(RuntimeError):
    """The judge failed a sample and the config says to fail the step."""


class JudgeConfigError(ValueError):
    pass


class UnparsedAnswer(ValueError):
    """The judge answered, but with no score in range."""


# -- the pure parts ------------------------------------------------------------------------
def prompt_text(prompt: Prompt) -> str:
    """The sample's prompt as the judge reads it: a chat prompt as `role: content` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content') or ''}" for m in prompt)


def fill_template(template: str, prompt: str, response: str, label: str | None) -> str:
    """`template` with {prompt}, {response} and {label} replaced in one pass, so a response
    that itself contains `{label}` is quoted as written, never filled in; other braces stay."""
    values = {"prompt": prompt, "response": response, "label": label or ""}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def parse_score(answer: str, pattern: str, min_score: float, max_score: float) -> float:
    """The score in `answer` (first group of `pattern`), scaled to [0, 1]; `UnparsedAnswer`
    when there is none or it is outside [min_score, max_score] (the judge did not follow the
    template, and clamping would invent a score it did not give)."""
    m = re.search(pattern, answer)
    if m is None or m.group(1) is None:
        raise UnparsedAnswer("no score in the answer")
    try:
        score = float(m.group(1))
    except ValueError:
        raise UnparsedAnswer(f"score {m.group(1)!r} is not a number") from None
    if not min_score <= score <= max_score:
        raise UnparsedAnswer(f"score {score:g} is outside [{min_score:g}, {max_score:g}]")
    return (score - min_score) / (max_score - min_score)


def request_body(cfg: JudgeConfig, filled: str) -> dict[str, Any]:
    """The OpenAI request for one filled template."""
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": cfg.max_tokens,
                            "temperature": cfg.temperature}
    if cfg.api == "completions":
        body["prompt"] = filled
        return body
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    body["messages"] = [*system, {"role": "user", "content": filled}]
    return body


def answer_text(body: Any, api: str) -> str:
    """The first choice's text of an OpenAI (chat) completion; ValueError if `body` is none."""
    try:
        choice = body["choices"][0]
        text = choice["message"]["content"] if api == "chat" else choice["text"]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"not an OpenAI {api} completion: {str(body)[:ANSWER_CHARS]}") from None
    return "" if text is None else str(text)  # (None: a refusal or a tool call, no text)


def judge_error_kind(metadata: Mapping[str, Any]) -> str | None:
    """`failed` or `unparsed` for a sample the judge scored 0, else None."""
    flag = metadata.get(JUDGE_ERROR)
    return str(flag).split(":", 1)[0] if flag else None


def count_judge_errors(samples: Iterable[Sample]) -> tuple[int, int, int]:
    """(failed, unparsed, retried): the samples the judge scored 0, by kind, and the requests
    sent again after the judge did not answer (an outage it rode out shows here)."""
    samples = list(samples)
    kinds = [judge_error_kind(s.metadata) for s in samples]
    retried = sum(int(s.metadata.get(JUDGE_RETRIES, 0)) for s in samples)
    return kinds.count(FAILED), kinds.count(UNPARSED), retried


# -- the reward ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Failure:
    kind: str  # FAILED or UNPARSED
    reason: str


class _Unreachable(Exception):
    """No usable answer from the judge this attempt: worth retrying after a backoff."""


class _Rejected(Exception):
    """A 4xx other than 429: repeating the same request cannot help."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message)  # both in args: it pickles across Ray
        self.status = status

    def __str__(self) -> str:
        return str(self.args[1])


class ScoreCache:
    """Rewards by request digest, least recently used dropped first; thread-safe (the
    rollout actor may score from more than one thread)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.hits = 0
        self._scores: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> float | None:
        with self._lock:
            score = self._scores.get(key)
            if score is not None:
                self._scores.move_to_end(key)
                self.hits += 1
            return score

    def put(self, key: str, score: float) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._scores[key] = score
            self._scores.move_to_end(key)
            while len(self._scores) > self.size:
                self._scores.popitem(last=False)

    def __len__(self) -> int:
        return len(self._scores)


class JudgeReward:
    """The judge as a reward function (`RewardFn`: `await judge.score(args, sample)`); one per
    run, shared by `rm_type: judge` and every sample's `metadata.rm_type: judge`, so they
    share the cache and the concurrency cap."""

    def __init__(self, cfg: JudgeConfig, api_key: str | None = None) -> None:
        self.cfg = cfg
        self.url = f"{cfg.base_url.rstrip('/')}/{'chat/completions' if cfg.api == 'chat' else 'completions'}"
        self.shown_url = redact_url(self.url) or self.url
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.cache = ScoreCache(cfg.cache_size if cfg.temperature == 0 else 0)
        # One semaphore per event loop: the rollout manager runs a fresh loop every step,
        # and an asyncio semaphore is bound to the loop it first waited on.
        self._slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary())
        self._slots_lock = threading.Lock()

    @classmethod
    def from_config(cls, cfg: JudgeConfig) -> JudgeReward:
        """Read the API key from `cfg.api_key_env` here, where rewards run."""
        if cfg.api_key_env is None:
            return cls(cfg)
        key = os.environ.get(cfg.api_key_env)
        if not key:
            raise JudgeConfigError(
                f"rollout.judge.api_key_env: ${cfg.api_key_env} is not set in this process "
                f"(pid {os.getpid()}); the rollout actor reads it from the Ray head's "
                "environment, so export it before the head starts (`rollflow cluster down`, "
                "then run again) or give it in cluster.runtime_env.env_vars"
            )
        return cls(cfg, key)

    def _slot(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        with self._slots_lock:
            if loop not in self._slots:
                self._slots[loop] = asyncio.Semaphore(self.cfg.max_concurrency)
            return self._slots[loop]

    def filled(self, sample: Sample) -> str:
        return fill_template(self.cfg.template, prompt_text(sample.prompt), sample.response,
                             None if sample.label is None else str(sample.label))

    async def score(self, args: Any, sample: Sample, /) -> float:
        """The sample's reward in [0, 1], or per `on_failure` when the judge fails it."""
        body = request_body(self.cfg, self.filled(sample))
        key = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        cached = self.cache.get(key)
        if cached is not None:
            sample.metadata.pop(JUDGE_ERROR, None)
            return cached
        sample.metadata.pop(JUDGE_RETRIES, None)
        result = await self._ask(sample, body)
        if isinstance(result, Failure):
            return self._failed(sample, result)
        self.cache.put(key, result)
        sample.metadata.pop(JUDGE_ERROR, None)
        return result

    async def _ask(self, sample: Sample, body: dict[str, Any]) -> float | Failure:
        """Up to 1 + max_retries requests: an unanswered one is retried after a backoff; an
        unparsed answer is re-asked under retry_then_fail only."""
        cfg, failure, waits = self.cfg, None, 0
        async with httpx.AsyncClient(timeout=cfg.timeout_s, verify=tls_verify(self.url),
                                     headers=self.headers) as client:
            for attempt in range(cfg.max_retries + 1):
                if failure is not None and failure.kind == FAILED:
                    await asyncio.sleep(backoff_delay(waits, cfg.backoff_s, MAX_BACKOFF_S))
                    waits += 1
                    sample.metadata[JUDGE_RETRIES] = waits
                try:
                    answer = await self._post(client, body)
                except _Unreachable as e:
                    failure = Failure(FAILED, f"no answer after {attempt + 1} attempt(s): {e}")
                    log.info("judge %s: %s (%s, attempt %d)", self.shown_url, e,
                             sample.describe(), attempt + 1)
                    continue
                except _Rejected as e:
                    if e.status in REFUSED:
                        raise JudgeError(
                            f"rollout.judge ({self.shown_url}): {sample.describe()}: the judge "
                            f"refuses the request itself, {e} (check rollout.judge.base_url, "
                            ".model and .api_key_env); every sample would fail") from None
                    return Failure(FAILED, str(e))
                try:
                    return parse_score(answer, cfg.score_pattern, cfg.min_score, cfg.max_score)
                except UnparsedAnswer as e:
                    failure = Failure(UNPARSED, f"{e}; answer: {answer[:ANSWER_CHARS]!r}")
                    if cfg.on_failure != "retry_then_fail":
                        return failure
                    log.info("judge %s: %s: %s (attempt %d)", self.shown_url, sample.describe(),
                             failure.reason, attempt + 1)
        assert failure is not None  # (the loop runs at least once and returns on success)
        return failure

    async def _post(self, client: httpx.AsyncClient, body: dict[str, Any]) -> str:
        async with self._slot():
            try:
                response = await client.post(self.url, json=body)
            except httpx.TransportError as e:  # connect/read errors and timeouts
                raise _Unreachable(repr(e)) from None
        if response.status_code == 429 or response.status_code >= 500:
            raise _Unreachable(f"HTTP {response.status_code}: {response.text.strip()[:200]}")
        if response.status_code >= 400:
            raise _Rejected(response.status_code,
                            f"HTTP {response.status_code}: {response.text.strip()[:200]}")
        try:
            return answer_text(response.json(), self.cfg.api)
        except ValueError as e:  # not JSON, or JSON of another shape (a proxy's page)
            raise _Unreachable(str(e)) from None

    def _failed(self, sample: Sample, failure: Failure) -> float:
        if self.cfg.on_failure == "zero":
            log.warning("judge %s: %s scored 0: %s: %s", self.shown_url, sample.describe(),
                        failure.kind, failure.reason)
            sample.metadata[JUDGE_ERROR] = f"{failure.kind}: {failure.reason}"
            return 0.0
        raise JudgeError(
            f"rollout.judge ({self.shown_url}): {sample.describe()}: {failure.kind}: "
            f"{failure.reason} (rollout.judge.on_failure: {self.cfg.on_failure}; `zero` scores "
            "such samples 0, flagged in metadata.judge_error)"
        )
