"""`verifiers://<env_id>?<args>`: a verifiers (v1) environment, its tasks and episodes.

```
 rollout actor ── run_episode(gateway URL of the sample, task) ──► verifiers Env.run_episode
                                                                   │ each agent seat plays in
                                                                   │ GatewayChatHarness
   reward ◄── the policy trace's rubric (rewards, weighted) ◄──────┤ its calls: verifiers'
                                                                   ▼ interception → base_url
                                         agent gateway: exact tokens, the rollout's sampling
```

`env_id` is what verifiers loads: an installed taskset package (`pip install` it, or a Hub id
`owner/name@version` of one installed), or a dotted module path of one written next to the
run's config (`my_pkg.my_env`, handed to verifiers under an alias since verifiers imports
only top-level names). The package's taskset gives the tasks; its `Env` (or the paired
`env=<id>`) the control flow: a multi-turn environment speaks between the model's turns
through an `interaction`. Arguments:

- `<field>=<value>`: the taskset's config (`split=test`, `num_tasks=8`, `task.tolerance=0.1`);
- `eval.<field>=<value>`: the same, for the held-out set (`tasks("eval")`); without any,
  there is none;
- `limit=<n>`, `eval.limit=<n>`: the first n tasks (an endless taskset needs one);
- `env=<id>`, `env.<field>=<value>`: a verifiers Env paired by id, and the Env's config;
- `harness=<id>`: the seats' harness (default rollflow's chat loop, `GatewayChatHarness`).

Values are typed by the config they land in; `[..]` and `{..}` are read as JSON.

An episode is verifiers' own: `Env.run_episode` under `Env.serving()`, every seat on the
local subprocess runtime, its model calls through the sample's gateway URL. The reward is the
policy trace's (the task's `@reward`s, weighted and summed); each reward and metric goes to
`EpisodeResult.metrics` as `reward/<name>` and `metric/<name>`. An episode verifiers reports
failed raises with verifiers' error, so it fails its sample instead of training a 0.
verifiers draws no randomness per episode (a task carries its own seeds), so the `seed`
argument is unused: the same task and the same model answers make the same calls.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from engines.environments.base import (
    MODEL_NAME,
    EnvironmentError,
    EnvironmentTask,
    EpisodeResult,
    Split,
    json_round_trip,
)
from engines.environments.registry import query_args

SCHEME = "verifiers://"
INSTALL_HINT = "pip install 'rollflow[envs]'"
RESERVED = ("env", "harness", "limit")


def open_verifiers_environment(uri: str) -> VerifiersEnvironment:
    """The environment `uri` names; raises EnvironmentError naming what is wrong with it."""
    env_id, args = parse_uri(uri)
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise EnvironmentError(uri, f"verifiers is not installed ({e}): {INSTALL_HINT}") from None
    return VerifiersEnvironment(uri, vf, env_id, args)


def parse_uri(uri: str) -> tuple[str, dict[str, Any]]:
    """(env id, args as nested dicts: `a.b=1` gives {"a": {"b": 1}}) of a verifiers URI."""
    if not uri.startswith(SCHEME):
        raise EnvironmentError(uri, f"a verifiers environment URI starts with {SCHEME}")
    env_id = uri[len(SCHEME):].split("?", 1)[0].strip("/")
    if not env_id:
        raise EnvironmentError(uri, "no environment id: verifiers://<env_id>?<arg>=<value>")
    args: dict[str, Any] = {}
    for key, raw in query_args(uri).items():
        path = key.split(".")
        if not all(path):
            raise EnvironmentError(uri, f"argument {key!r}: an empty name")
        node = args
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise EnvironmentError(uri, f"argument {key!r}: {part!r} is given a value too")
            node = child
        if isinstance(node.get(path[-1]), dict):
            raise EnvironmentError(uri, f"argument {key!r}: it also has fields")
        node[path[-1]] = _value(uri, key, raw)
    return env_id, args


def _value(uri: str, key: str, raw: str) -> Any:
    if raw[:1] not in "[{":
        return raw  # pydantic types it (lax: "3" is an int field's 3, "true" a bool's True)
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise EnvironmentError(uri, f"argument {key!r}: not JSON ({e})") from None


class VerifiersEnvironment:
    """An opened verifiers environment (engines.environments.base.Environment)."""

    def __init__(self, uri: str, vf: Any, env_id: str, args: dict[str, Any]) -> None:
        from engines.environments import verifiers_harness

        self.uri = uri
        self._vf = vf
        self._taskset_id = _verifiers_id(uri, env_id)
        _alias(uri, verifiers_harness.HARNESS_ID, verifiers_harness)
        args = dict(args)
        self._limits = {"train": _limit(uri, "limit", args.pop("limit", None)),
                        "eval": None}
        eval_args = args.pop("eval", None)
        if eval_args is not None and not isinstance(eval_args, dict):
            raise EnvironmentError(uri, "eval: give eval.<taskset field>=<value> arguments")
        if eval_args is not None:
            eval_args = dict(eval_args)
            self._limits["eval"] = _limit(uri, "eval.limit", eval_args.pop("limit", None))
        env_args = args.pop("env", None)
        paired, env_fields = (env_args, {}) if isinstance(env_args, str) or env_args is None \
            else ("", env_args)
        harness = args.pop("harness", verifiers_harness.HARNESS_ID)
        if not isinstance(harness, str):
            raise EnvironmentError(uri, "harness: give harness=<id>")
        try:
            self._env = vf.load_environment(self._env_config(paired or "", env_fields, args,
                                                             harness))
            self._tasksets: dict[str, Any] = {"train": self._env.taskset}
            if eval_args is not None:
                config = {**self._env.config.taskset.model_dump(exclude_unset=True),
                          **eval_args, "id": self._taskset_id}
                self._tasksets["eval"] = vf.load_taskset(
                    type(self._env.config.taskset).model_validate(config))
        except EnvironmentError:
            raise
        except Exception as e:  # noqa: BLE001 - verifiers' errors are many; each names the problem
            raise EnvironmentError(uri, f"verifiers cannot load {env_id!r}: {_why(e)}") from None
        self._serving = _SharedServing(self._env)
        self._tasks: dict[str, list[Any]] = {}

    def _env_config(self, paired: str, env_fields: dict[str, Any], taskset: dict[str, Any],
                    harness: str) -> Any:
        """The env config with every seat on `harness` in the local subprocess runtime; more
        than one seat that talks to the policy is refused (one sample is one agent's tokens)."""
        vf = self._vf
        cls = vf.env_config_type(self._taskset_id, paired)
        seats = [name for name, info in cls.model_fields.items()
                 if isinstance(info.default, vf.AgentConfig)]
        policy = [name for name in seats if cls.model_fields[name].default.client is None]
        if len(policy) > 1:
            raise EnvironmentError(self.uri, f"the environment's seats {policy} all play the "
                                             "policy; rollflow trains one agent per sample")
        unknown = set(env_fields) & set(seats)
        if unknown:
            raise EnvironmentError(self.uri, f"env.{sorted(unknown)[0]}: seats are set by "
                                             "rollflow (harness=<id> picks their harness)")
        seat = {"harness": {"id": harness}, "runtime": {"type": "subprocess"}}
        return vf.resolve_env_config({**env_fields, "id": paired, **dict.fromkeys(seats, seat),
                                      "taskset": {**taskset, "id": self._taskset_id}})

    # -- tasks -----------------------------------------------------------------------------
    def tasks(self, split: Split) -> Sequence[EnvironmentTask]:
        return [self._row(split, i, task) for i, task in enumerate(self._load(split))]

    def _load(self, split: Split) -> list[Any]:
        if split not in self._tasks:
            taskset = self._tasksets.get(split)
            if taskset is None:
                raise EnvironmentError(self.uri, "no held-out set: name its tasks with "
                                                 "eval.<taskset field>=<value> arguments "
                                                 "(e.g. eval.split=test)")
            limit = self._limits[split]
            if limit is None and taskset.INFINITE:
                key = "limit" if split == "train" else "eval.limit"
                raise EnvironmentError(self.uri, f"the taskset never ends: bound it with {key}=<n>")
            view = taskset if limit is None else taskset.take(limit)
            self._tasks[split] = list(view)
        return self._tasks[split]

    def _row(self, split: Split, index: int, task: Any) -> EnvironmentTask:
        data = task.data
        answer = getattr(data, "answer", None)
        row = EnvironmentTask(
            prompt=data.prompt_text,
            answer=None if answer is None else str(answer),
            data={"split": split, "task": data.model_dump(mode="json", exclude_defaults=True)})
        return json_round_trip(self.uri, row, index)

    def _task(self, task: EnvironmentTask) -> Any:
        """The verifiers task a stored row names, built as its taskset builds it."""
        split = task.data.get("split")
        taskset = self._tasksets.get(str(split))
        if taskset is None or "task" not in task.data:
            raise EnvironmentError(self.uri, f"not a task of this environment: {task.prompt!r}")
        cls = type(taskset).task_type()
        try:
            data = cls.data_type().model_validate(task.data["task"])
        except Exception as e:  # noqa: BLE001 - pydantic's ValidationError names the field
            raise EnvironmentError(self.uri, f"task {task.prompt!r}: {e}") from None
        return cls(data, taskset.config.task)

    # -- episodes --------------------------------------------------------------------------
    async def run_episode(self, base_url: str, task: EnvironmentTask, seed: int) -> EpisodeResult:
        vf = self._vf
        ctx = vf.ModelContext(model=MODEL_NAME, client=vf.EvalClientConfig(
            base_url=base_url, api_key_var="ROLLFLOW_GATEWAY_KEY_UNUSED"))
        async with self._serving.held():
            episode = await self._env.run_episode(self._task(task), ctx)
        policy = [t for t in episode.traces if t.agent is None or t.agent.trainable]
        if not episode.ok or len(policy) != 1:
            raise EnvironmentError(self.uri, f"episode of {task.prompt!r} failed: "
                                             f"{_failure(episode, len(policy))}")
        trace = policy[0]
        metrics = {f"reward/{name}": r.score for name, r in trace.rewards.items() if r is not None}
        metrics |= {f"metric/{name}": v for name, v in trace.metrics.items() if v is not None}
        metrics["turns"] = float(trace.num_turns)
        return EpisodeResult(reward=float(trace.reward), metrics=metrics)

    def close(self) -> None:
        """Nothing to release: verifiers' servers live only while episodes run."""


class _SharedServing:
    """`Env.serving()` (verifiers' interception server, the taskset's shared tools) held
    while any episode runs: entered by the first, left by the last, so nothing outlives the
    rollout's event loop and concurrent episodes share one (verifiers keeps it on the env)."""

    def __init__(self, env: Any) -> None:
        self._env = env
        self._users = 0
        self._stack: AsyncExitStack | None = None
        self._lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    def _gate(self) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock[0] is not loop:
            if self._users:
                raise RuntimeError("verifiers episodes of one environment on two event loops")
            self._lock = (loop, asyncio.Lock())
        return self._lock[1]

    @asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        async with self._gate():
            if self._users == 0:
                stack = AsyncExitStack()
                await stack.enter_async_context(self._env.serving())
                self._stack = stack
            self._users += 1
        try:
            yield
        finally:
            async with self._gate():
                self._users -= 1
                if self._users == 0 and self._stack is not None:
                    stack, self._stack = self._stack, None
                    await stack.aclose()


def _failure(episode: Any, policy_traces: int) -> str:
    if policy_traces != 1 and episode.ok:
        return (f"{policy_traces} runs of the policy in one episode; rollflow trains one "
                "agent run per sample")
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if not errors:
        return "verifiers reports it not ok, without an error"
    last = errors[-1]
    return f"{last.type}: {last.message}"[:500]


def _why(e: Exception) -> str:
    """verifiers' error; a config's validation errors as the URI arguments they came from."""
    from pydantic import ValidationError

    if not isinstance(e, ValidationError):
        return f"{type(e).__name__}: {e}"
    problems = []
    for err in e.errors():
        loc = [str(part) for part in err["loc"]]
        if e.title.endswith("EnvConfig"):  # the env config: its taskset, or its own fields
            loc = loc[1:] if loc[:1] == ["taskset"] else ["env", *loc]
        else:  # the held-out set's taskset config
            loc = ["eval", *loc]
        problems.append(f"{'.'.join(loc)}: {err['msg']}")
    return "; ".join(problems)


def _limit(uri: str, key: str, value: Any) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise EnvironmentError(uri, f"{key}: a number of tasks, at least 1 (got {value!r})")
    return n


def _verifiers_id(uri: str, env_id: str) -> str:
    """The id verifiers imports: `env_id` itself, or for a dotted module path the alias it
    is registered under (verifiers imports only top-level names)."""
    if "." not in env_id.rsplit("/", 1)[-1].split("@", 1)[0]:
        return env_id
    try:
        module = importlib.import_module(env_id)
    except ImportError as e:
        raise EnvironmentError(uri, f"cannot import {env_id}: {e}") from None
    alias = ("rollflow_env__" + env_id.replace(".", "__")).lower()
    _alias(uri, alias, module)
    return alias


def _alias(uri: str, name: str, module: Any) -> None:
    present = sys.modules.setdefault(name, module)
    if present is not module:
        raise EnvironmentError(uri, f"the module name {name!r} is taken by {present!r}")
