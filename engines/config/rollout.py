"""The sections the rollout actor is built from besides `data` (data.py) and `engine`
(engine.py): rollout (generation loop, rewards, filters) and eval."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_serializer, model_validator

from engines.config.data import DataConfig
from engines.config.judge import JudgeConfig
from engines.config.sandbox import SandboxConfig
from storage.config import Section
from storage.secrets import redact_url

ENVIRONMENT_SCHEMES = ("verifiers://", "openenv://")
_ENVIRONMENT_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*(\?.*)?$")


def is_environment_uri(value: str) -> bool:
    """What `rollout.environment` takes: a `verifiers://` or `openenv://` URI, or a
    `pkg.module:factory[?args]` import string (engines/environments/registry.py opens it)."""
    return value.startswith(ENVIRONMENT_SCHEMES) or bool(_ENVIRONMENT_FACTORY.match(value))


class RolloutConfig(Section):
    num_rollout: int = Field(..., ge=1, description="Rollout steps in the run.")
    rollout_batch_size: int = Field(..., ge=1, description="Groups (prompts) trained per step.")
    n_samples_per_prompt: int = Field(
        1, ge=1, description="Samples per prompt (group size); 2 or more for the estimators "
        "that compare a prompt's samples (grpo, gspo, rloo, reinforce_plus_plus_baseline)."
    )
    over_sampling_batch_size: int | None = Field(
        None, ge=1, description="Groups submitted at a time (default: rollout_batch_size)."
    )
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 disables top-k.")
    max_response_len: int = Field(64, ge=1, description="max_new_tokens of each request.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    stop_token_ids: list[int] = Field(default_factory=list, description="Extra stop token ids.")
    seed: int = Field(1234, description="Base seed of sampling requests.")
    mode: Literal["sync", "one_step", "async"] = Field(
        "sync",
        description="sync: generate, train, push, one step after the other. one_step: "
        "generation of step k+1 overlaps training of step k (slime's train_async). async: "
        "generation never stops; up to rollout.async_inflight groups generate across step "
        "boundaries and each step trains the first rollout_batch_size groups that finish "
        "(engines/rollout/async_producer.py). docs/training.md has a picture of each.",
    )
    async_inflight: int | None = Field(
        None, ge=1,
        description="Async mode: groups generating at once (default: 2 x "
        "rollout_batch_size). Fewer start when more would be too stale to train "
        "(rollout.max_staleness).",
    )
    max_staleness: int = Field(
        1, ge=0,
        description="one_step and async modes: a step trained from weight version k trains "
        "no token generated before version k - max_staleness (rounded down to a "
        "train.update_weights_interval push). one_step: generation of step k waits until the "
        "engines hold that version; buffered samples started on an older one are "
        "regenerated from the prompt (rollout/groups_stale_regenerated_samples). async: a "
        "finished group begun on an older version is regenerated or dropped "
        "(rollout.stale_groups). 0 in one_step stays on-policy: only the next step's "
        "flow-run set-up and prompt draw overlap this step's training.",
    )
    async_take: Literal["due_first", "finish_order"] = Field(
        "due_first",
        description="Async mode: which finished groups a step takes. due_first: first the "
        "groups this step is the last allowed to train (begun on the oldest version it may "
        "train), waiting for those still generating, then the others in finish order (the "
        "run's last step takes the first to finish); no "
        "group outlives the staleness bound, so long responses train as often as they are "
        "drawn. finish_order: the first to finish; a group still generating when its last "
        "step passes goes stale (rollout.stale_groups), which leaves long responses behind.",
    )
    stale_groups: Literal["regenerate", "drop"] = Field(
        "regenerate",
        description="one_step and async modes: a group with a sample begun on a policy older "
        "than max_staleness allows. regenerate: those samples start over from the prompt "
        "(rollout/groups_stale_regenerated_samples); drop: the group is neither generated "
        "nor trained, its prompt is not drawn again, and the step draws another in its "
        "place (rollout/groups_stale_dropped).",
    )
    function_path: str | None = Field(
        None,
        description="Custom rollout function `(args, rollout_id, data_source, evaluation)` "
        "(import string), e.g. an SFT rollout; None uses the generation loop.",
    )
    buffer_filter_path: str | None = Field(
        None, description="Buffer filter `(args, rollout_id, buffer, num_samples) -> groups`."
    )
    sample_filter_path: str | None = Field(
        None,
        description="Per-sample filter `(args, sample) -> bool`, called on each trained "
        "sample once its reward is final (slime's --rollout-sample-filter-path): False keeps "
        "the sample in its group's reward statistics but out of the loss (its loss mask is "
        "zeroed in train.arrow). Counted as reward/removed_samples.",
    )
    rm_type: str | None = Field(
        None,
        description="Built-in reward (rm hub): math, deepscaler, dapo, f1, exact_match, "
        "last_number, remote_rm; reasoning_gym (a reasoning_gym:// prompt set graded by its "
        "task's own scorer); code_tests (the response's program run against the label's "
        "tests in a sandbox, rollout.sandbox); `boxed_<rule>` scores only the last \\boxed{...}.",
    )
    custom_rm_path: str | None = Field(
        None,
        description="Async reward fn `(args, sample) -> reward` (import string); with group_rm "
        "`(args, samples) -> list[reward]`.",
    )
    group_rm: bool = Field(
        False, description="Call custom_rm_path once per group with all its samples."
    )
    rm_url: str | None = Field(
        None, repr=False, description="remote_rm: URL receiving the JSON POST (a password in it is shown "
        "as REDACTED in config.yaml and the UI)."
    )
    rm_timeout_s: float = Field(30.0, gt=0.0, description="remote_rm: per-request timeout.")
    rm_max_retries: int = Field(
        5, ge=0, description="remote_rm: retries on timeouts, transport errors, 429 and 5xx."
    )
    rm_backoff_s: float = Field(
        1.0, ge=0.0, description="remote_rm: first retry delay, doubled each retry (cap 30 s)."
    )
    judge: JudgeConfig | None = Field(
        None,
        description="rm_type judge: the LLM judge, any OpenAI-compatible API (base_url, "
        "model, template, score_pattern, on_failure; engines/config/judge.py).",
    )
    rm_rule_timeout_s: float = Field(
        10.0, gt=0.0,
        description="Deadline to grade one sample with a math rule (math, deepscaler, dapo and "
        "their boxed_ forms) or reasoning_gym, which run in worker processes; past it the "
        "sample scores as a failure and counts in rollout/reward_timeouts.",
    )
    reward_key: str | None = Field(None, description="Key picked from dict rewards.")
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="rm_type code_tests: the sandbox the model's programs run in and how "
        "their tests become a reward (engines/config/sandbox.py).",
    )
    sglang_server_concurrency: int = Field(
        256, ge=1,
        description="In-flight generate requests per engine; the loop allows this times the "
        "number of engines (slime's semaphore).",
    )
    max_request_samples: int = Field(
        1024, ge=1,
        description="Without the router: groups that start together share one /generate "
        "request of at most this many samples (a larger group goes alone) when all of them "
        "must finish anyway (no dynamic filter, no over-sampling; evaluation); otherwise, and "
        "with 1, each group is its own request. Per-request HTTP, JSON and prefill costs add "
        "up on a fast engine (bench/RESULTS.md, \"vs TRL\").",
    )
    ignore_eos: bool = Field(
        False, description="Generate past EOS up to max_response_len (benchmarks, tests)."
    )
    use_router: bool = Field(
        True,
        description="Send requests through a supervised sglang-router process (False: "
        "round-robin straight to the engines).",
    )
    router_policy: Literal["cache_aware", "round_robin", "random", "power_of_two", "manual"] = (
        Field("cache_aware", description="sglang-router load-balancing policy.")
    )
    dynamic_sampling_filter_path: str | None = Field(
        None,
        description="Dynamic-sampling filter `(args, group) -> bool` (import string or a "
        "engines.rollout.filters name, e.g. check_reward_nonzero_std); rejected groups are dropped.",
    )
    over_sampling_filter_path: str | None = Field(
        None,
        description="Over-sampling filter `(args, groups) -> groups` (import string or a "
        "engines.rollout.filters name, e.g. sort_by_reward_std). When set, generation keeps "
        "over_sampling_batch_size groups and the filter stage picks rollout_batch_size.",
    )
    custom_generate_function_path: str | None = Field(
        None,
        description="`async (args, sample, sampling_params) -> Sample` used per sample instead "
        "of the HTTP /generate call (multi-turn agents, tools).",
    )
    agent_path: str | None = Field(
        None,
        description="An agent written against an OpenAI client, `async (base_url, sample, "
        "**kw) -> reward | sample | None` (import string): each sample gets a base URL of a "
        "token-capturing gateway (engines/rollout/agent_gateway.py) and the sample is built "
        "from the exact tokens of its calls. Excludes custom_generate_function_path.",
    )
    environment: str | None = Field(
        None,
        description="An environment brought from outside (docs/environments.md): "
        "`verifiers://<env_id>?<arg>=<value>`, `openenv://<module:Class or URL>?...`, or "
        "`pkg.module:factory?<arg>=<value>` for one you wrote. Its tasks are the prompts "
        "(data.prompt_data defaults to this URI; an eval.datasets entry with this path and "
        "split 'eval' is its held-out set), each sample is one episode through the agent "
        "gateway, and the episode's reward is the sample's. Excludes agent_path, "
        "custom_generate_function_path, function_path and rm_type.",
    )
    agent_gateway_host: str = Field(
        "127.0.0.1", description="Address the agent gateway listens on (the agent's side)."
    )
    engine_health_interval_s: float = Field(
        2.0, ge=0.0,
        description="Seconds between health probes of each engine while a step generates "
        "(GET /health); a dead or hung engine is taken out and its requests go "
        "to the others, and the generate task replaces it (0: no probes; a lost engine then "
        "fails the step and the task retry recreates it).",
    )
    engine_hang_timeout_s: float = Field(
        30.0, gt=0.0,
        description="A health probe unanswered for this long marks its engine hung (lost).",
    )
    partial_rollout: bool = Field(
        False,
        description="Aborted groups go back to the buffer with their partial tokens and are "
        "continued later (False: they go back as fresh prompts).",
    )
    mask_offpolicy_in_partial_rollout: bool = Field(
        False,
        description="When a partial sample is continued, set the loss mask of the tokens an "
        "older policy generated to 0.",
    )
    journal_groups: bool = Field(
        True,
        description="Store each group generation finishes (and each draw) as it happens, "
        "under steps/{id}/groups/, so a rerun of a step that crashed mid-generate keeps the "
        "finished groups and generates only those in flight (False: a rerun regenerates "
        "the whole step).",
    )
    max_groups_per_step: int | None = Field(
        None, ge=1,
        description="Dynamic sampling gives up after drawing this many groups in one step "
        "(None: 10 x the kept target) and trains on what it kept.",
    )
    debug_rollout_only: bool = Field(
        False, description="Generate and save rollouts but never train (no trainer actor)."
    )
    debug_train_only: bool = Field(
        False,
        description="Train on the saved train batches of debug_rollout_data; no engines.",
    )
    debug_rollout_data: str | None = Field(
        None,
        description="Run directory (path or URI) whose steps/{id}/train.arrow feed "
        "debug_train_only.",
    )

    @field_serializer("rm_url")
    def _redact_rm_url(self, url: str | None) -> str | None:
        return redact_url(url)

    @property
    def submit_batch_size(self) -> int:
        return self.over_sampling_batch_size or self.rollout_batch_size

    @property
    def overlaps_steps(self) -> bool:
        """Whether consecutive steps overlap (one_step, async): the gates of
        tasks/step_gates.py order them and a step may train stale tokens."""
        return self.mode != "sync"

    @property
    def inflight_groups(self) -> int:
        """Async mode: groups generating at once."""
        return self.async_inflight or 2 * self.rollout_batch_size

    @model_validator(mode="after")
    def _check_rollout(self) -> RolloutConfig:
        if self.debug_rollout_only and self.debug_train_only:
            raise ValueError("rollout.debug_rollout_only and rollout.debug_train_only exclude "
                             "each other")
        if self.debug_train_only and not self.debug_rollout_data:
            raise ValueError("rollout.debug_train_only needs rollout.debug_rollout_data (the "
                             "run directory to train from)")
        if self.over_sampling_batch_size is not None and self.over_sampling_filter_path and (
            self.over_sampling_batch_size < self.rollout_batch_size
        ):
            raise ValueError("rollout.over_sampling_batch_size must be >= rollout_batch_size "
                             "when rollout.over_sampling_filter_path is set")
        if self.agent_path and self.custom_generate_function_path:
            raise ValueError("rollout.agent_path and rollout.custom_generate_function_path "
                             "exclude each other: the agent gateway is the generate function")
        if self.environment is not None:
            self._check_environment(self.environment)
        if self.mode == "async":
            self._check_async()
        return self

    def _check_environment(self, uri: str) -> None:
        """An environment runs the episodes and gives the rewards: nothing else may."""
        if not is_environment_uri(uri):
            raise ValueError(f"rollout.environment: {uri!r} is not verifiers://<env_id>, "
                             "openenv://<module:Class or URL>, or pkg.module:factory")
        for key in ("agent_path", "custom_generate_function_path", "function_path",
                    "rm_type", "custom_rm_path"):
            if getattr(self, key):
                raise ValueError(f"rollout.environment excludes rollout.{key}: the "
                                 "environment runs each episode and gives its reward")

    def _check_async(self) -> None:
        """What async mode cannot combine with: each step takes groups as they finish, from
        a generation loop that never stops."""
        clashes = {
            "function_path": "a custom rollout function generates a whole step itself",
            "over_sampling_filter_path": "a step takes the first groups that finish, so "
            "there is no over-sampled batch to choose from",
            "debug_train_only": "nothing is generated",
        }
        for key, why in clashes.items():
            if getattr(self, key):
                raise ValueError(f"rollout.mode: async excludes rollout.{key} ({why})")


class EvalDataset(Section):
    """One held-out set; unset sampling fields fall back to the rollout section's."""

    name: str = Field(..., description="Metric prefix: eval/{name}.")
    path: str = Field(..., description="Prompts, in any form data.prompt_data takes.")
    split: str | None = Field(
        None, description="Split of a dataset that has several; default: its only one, else "
        "'test'."
    )
    input_key: str | None = Field(
        None, description="Column/key holding the prompt (default: data.input_key)."
    )
    label_key: str | None = Field(
        None, description="Column/key holding the label (default: data.label_key)."
    )
    metadata_key: str | None = Field(
        None,
        description="Column/key with a metadata dict, e.g. a per-row rm_type (default: "
        "data.metadata_key).",
    )
    apply_chat_template: bool | None = Field(
        None,
        description="Render prompts through the tokenizer's chat template (default: "
        "data.apply_chat_template).",
    )
    n_samples_per_eval_prompt: int = Field(1, ge=1, description="Samples per prompt.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature (0: greedy).")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Default: rollout.top_p.")
    top_k: int | None = Field(None, description="Default: rollout.top_k (-1 disables).")
    max_response_len: int | None = Field(None, ge=1, description="Default: rollout's.")
    stop: list[str] | None = Field(None, description="Stop strings (default: rollout's).")
    stop_token_ids: list[int] | None = Field(None, description="Default: rollout's.")
    rm_type: str | None = Field(None, description="Reward for this set (default: the run's).")
    custom_rm_path: str | None = Field(
        None, description="Async reward fn `(args, sample)` for this set (default: the run's)."
    )
    max_prompts: int | None = Field(None, ge=1, description="Use only the first N prompts.")


class EvalConfig(Section):
    datasets: list[EvalDataset] = Field(default_factory=list)
    eval_interval: int | None = Field(
        None, ge=1,
        description="Evaluate every N steps (in one-step off-policy mode too: the step's flow "
        "run evaluates its new weights before it commits, while no other step can change them).",
    )
    before_train: bool = Field(True, description="Evaluate the initial policy too.")
    eval_function_path: str | None = Field(
        None,
        description="Custom evaluation `async (args, weight_version) -> {metric: value}` "
        "(import string; slime's --eval-function-path), run after the datasets' evaluation "
        "(none needed) with `args` holding the run config, engine_url(s) and tokenizer; "
        "metric names get an `eval/` prefix if they lack one.",
    )

    @property
    def enabled(self) -> bool:
        """Whether the run evaluates at all: held-out sets or a custom eval function."""
        return bool(self.datasets or self.eval_function_path)

    @model_validator(mode="after")
    def _check_names(self) -> EvalConfig:
        names = [d.name for d in self.datasets]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"eval.datasets: names must be unique (repeated: {duplicates})")
        return self

    def inherit_data_keys(self, data: DataConfig) -> None:
        """Fill each dataset's unset row keys and chat-template flag from the data section,
        so an eval set shaped like the training set needs only name and path."""
        for ds in self.datasets:
            for key in ("input_key", "label_key", "metadata_key", "apply_chat_template"):
                if getattr(ds, key) is None:
                    object.__setattr__(ds, key, getattr(data, key))
