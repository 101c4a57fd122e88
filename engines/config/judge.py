"""The `rollout.judge` section: an LLM judge as the reward (`rollout.rm_type: judge`), reached
through any OpenAI-compatible API; engines/rollout/rewards/judge.py does the judging."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_serializer, model_validator

from storage.config import Section
from storage.secrets import redact_url

PLACEHOLDERS = ("prompt", "response", "label")
DEFAULT_TEMPLATE = (
    "You are grading a response to a question.\n\n"
    "Question:\n{prompt}\n\n"
    "Reference answer (empty if there is none):\n{label}\n\n"
    "Response:\n{response}\n\n"
    "Rate how correct and helpful the response is on a scale from 0 to 10. Explain briefly, "
    'then end with a line of the form "Score: N".'
)
# `Score: N` (the last one, markdown bold allowed) if the answer has one, else its last number.
DEFAULT_SCORE_PATTERN = r"(?is)\A(?:.*score[\s:=*]*|.*(?<![\d.\-]))(-?\d+(?:\.\d+)?)"
OnFailure = Literal["retry_then_fail", "zero", "fail"]


class JudgeConfig(Section):
    """A judge model grades each response: the template, filled with the sample's prompt,
    response and label, goes to `{base_url}/chat/completions` (or `/completions`); the number
    `score_pattern` finds in the answer, scaled from [min_score, max_score] to [0, 1], is the
    reward. A judge that cannot be reached, or whose answer holds no score, is never a silent
    0: `on_failure` says what happens, and every 0 it gives is flagged and counted."""

    base_url: str = Field(
        ..., repr=False,
        description="Base URL of an OpenAI-compatible API, with its version path, as OpenAI "
        "clients take it: https://api.openai.com/v1, or http://HOST:PORT/v1 for `rollflow "
        "engine` or SGLang. A password in it is shown as REDACTED in config.yaml and the UI.",
    )
    model: str = Field(..., description="The judge's model name, sent as the request's `model`.")
    api: Literal["chat", "completions"] = Field(
        "chat",
        description="chat: POST /chat/completions with the filled template as the user "
        "message; completions: POST /completions with it as the raw prompt.",
    )
    api_key_env: str | None = Field(
        None,
        description="Name of the environment variable holding the API key, sent as "
        "`Authorization: Bearer`; the key itself never enters the config. It must be set "
        "where rewards run (the rollout actor, under the Ray head's environment). None: no key.",
    )
    system_prompt: str | None = Field(
        None, description="A system message before the template (api: chat only)."
    )
    template: str = Field(
        DEFAULT_TEMPLATE,
        description="The judge's prompt; {prompt}, {response} and {label} are replaced by the "
        "sample's (a chat prompt as `role: content` lines; no label: empty). Other braces "
        "stay as written. Must contain {response}.",
    )
    score_pattern: str = Field(
        DEFAULT_SCORE_PATTERN,
        description="Regex searched in the judge's answer; its first group is the score. "
        "Default: the number after the last `Score:`, else the answer's last number.",
    )
    min_score: float = Field(0.0, description="Lowest score the template asks for.")
    max_score: float = Field(
        10.0, description="Highest score; a score outside [min_score, max_score] is unparsed."
    )
    max_tokens: int = Field(512, ge=1, description="max_tokens of each judge request.")
    temperature: float = Field(
        0.0, ge=0.0,
        description="Judge sampling temperature. At 0 (greedy) a repeated request gets the "
        "same answer, so scores are cached; above 0 nothing is cached.",
    )
    max_concurrency: int = Field(
        32, ge=1, description="Judge requests in flight at once, over all samples and groups."
    )
    timeout_s: float = Field(60.0, gt=0.0, description="Per-request timeout.")
    max_retries: int = Field(
        5, ge=0,
        description="Retries of a request that got no answer: transport errors, timeouts, 429 "
        "and 5xx, with exponential backoff (as remote_rm); retry_then_fail also re-asks on an "
        "unparsed answer, within the same count.",
    )
    backoff_s: float = Field(
        1.0, ge=0.0, description="First retry delay, doubled each retry (cap 30 s)."
    )
    on_failure: OnFailure = Field(
        "retry_then_fail",
        description="A judge still unreachable after max_retries, or an answer with no score "
        "in range. retry_then_fail: re-ask an unparsed answer too, then fail the step; zero: "
        "score 0, set metadata.judge_error to the reason and count it "
        "(rollout/judge_failures, rollout/judge_unparsed); fail: fail the step at once on an "
        "unparsed answer. A failing step names the URL, the sample and the answer.",
    )
    cache_size: int = Field(
        65536, ge=0,
        description="Scores kept per run by identical request (least recently used dropped "
        "first); used at temperature 0 only. 0: no cache.",
    )

    @field_serializer("base_url")
    def _redact_base_url(self, url: str) -> str | None:
        return redact_url(url)

    @model_validator(mode="after")
    def _check_judge(self) -> JudgeConfig:
        key = "rollout.judge"
        if "{response}" not in self.template:
            raise ValueError(f"{key}.template: has no {{response}}, so the judge would never "
                             "see the response it grades")
        try:
            groups = re.compile(self.score_pattern).groups
        except re.error as e:
            raise ValueError(f"{key}.score_pattern: not a regex: {e}") from None
        if groups < 1:
            raise ValueError(f"{key}.score_pattern: needs a group around the number, e.g. "
                             r"'Score: (\d+)'")
        if self.max_score <= self.min_score:
            raise ValueError(f"{key}.max_score ({self.max_score:g}) must be above "
                             f"{key}.min_score ({self.min_score:g})")
        if self.system_prompt is not None and self.api != "chat":
            raise ValueError(f"{key}.system_prompt: needs {key}.api: chat (a completion "
                             "request has no messages)")
        return self
