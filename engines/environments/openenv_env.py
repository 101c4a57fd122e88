"""`openenv://<module:Class or URL>?<args>`: an OpenEnv environment server, its episodes by seed.

```
 rollout actor                                   OpenEnv server (ours: a child process on
  run_episode(gateway URL, task {"seed": s})      127.0.0.1, a free port; or a running one)
   │ ws /ws ── {"type": "reset", "data": {"seed": s}} ──────────►  env.reset(seed=s)
   │ ◄── observation {fields..., reward, done} ────────────────────┘
   │ observation ─(adapter)─► user message ─► chat.completions ─► agent gateway ─► engine
   │ reply text ─(adapter)─► action {"message": text}
   │ ws /ws ── {"type": "step", "data": action} ──────────────────►  env.step(action)
   │ ◄── observation, reward, done ... until done or max_turns ────┘
   ▼
 EpisodeResult(reward: sum (or last) of the step rewards, metrics: each step's reward)
```

Two forms:

- `openenv://pkg.module:Name?...` starts the environment here: `Name` is an OpenEnv
  `Environment` subclass (served by `openenv.core.env_server.create_fastapi_app`, its Action
  and Observation classes read from `Environment[Action, Observation, State]` or from `step`'s
  annotations) or an app built with `create_app` (served as it is). The server is a child
  process (engines/environments/openenv_server.py), started on the first episode, restarted
  on the next one if it died, and stopped by `close()` or when its parent dies.
- `openenv://http://host:port?...` (or https, ws, wss) connects to a running server.

OpenEnv has no dataset: a task is an episode, named by the seed `reset` gets. `size=N&seed=S`
gives the train tasks S..S+N-1; `eval_size=M&eval_seed=E` the eval tasks E..E+M-1 (default:
M=N, E=S+1000000, a range of its own). Each sample of a group plays its task's episode; the
environment is expected to be deterministic given the seed and the actions, and the model's
answers are (the gateway's per-turn sampling seeds), so a restored or rerun sample makes the
same calls.

An observation becomes chat messages, and a reply an action, through an `EpisodeAdapter`:
the default takes the observation field `observation` (default `prompt`) as the next user
message (after an optional `system` message) and sends the reply text as the action field
`action` (default `message`: TextArena's and the echo environment's shape). `adapter=pkg.mod:X`
names another (a class, made with no arguments, or an object).

Episodes speak OpenEnv's WebSocket protocol (`/ws`: reset, step, close; one session per
episode) with `websockets` directly rather than through `openenv.core.EnvClient`: importing
openenv's client costs seconds (it loads gradio and mcp) on the rollout's event loop, and its
errors arrive as strings; the protocol is the one `openenv.core.env_server.http_server` serves.
Any failure of an episode (the server refused an action, crashed, did not answer) raises
`EnvironmentError` naming the URI, the seed and the turn: the sample fails (as an agent's
error does, agent_gateway.run_sample) and its group is not trained.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import json
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engines.environments.base import (
    MODEL_NAME,
    EnvironmentError,
    EnvironmentTask,
    EpisodeResult,
    Split,
)
from engines.environments.openenv_server import LocalServer, RunningServer, Server
from engines.environments.registry import query_args

SCHEME = "openenv://"
INSTALL_HINT = "pip install 'rollflow[envs]'"
EVAL_SEED_OFFSET = 1_000_000
_IMPORT_FORM = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_URL_SCHEMES = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}


class OpenEnvArgs(BaseModel):
    """The `?<arg>=<value>` part of an `openenv://` URI."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int = Field(100, ge=1, description="Train tasks: the episodes of seeds seed..seed+size-1.")
    seed: int = Field(0, ge=0, description="The first train task's reset seed.")
    eval_size: int | None = Field(None, ge=1, description="Eval tasks (None: size).")
    eval_seed: int | None = Field(
        None, ge=0, description="The first eval task's reset seed (None: seed + 1000000).")
    observation: str = Field(
        "prompt", description="The observation field whose text is the next user message.")
    action: str = Field("message", description="The action field that carries the reply text.")
    system: str | None = Field(None, description="A system message opening each conversation.")
    adapter: str | None = Field(
        None, description="`pkg.mod:X`, an EpisodeAdapter in place of observation/action/system.")
    max_turns: int = Field(8, ge=1, description="Model turns (env steps) at most per episode.")
    max_tokens: int | None = Field(
        None, ge=1, description="Tokens per model turn at most (None: the sample's budget).")
    reward: Literal["sum", "last"] = Field(
        "sum", description="The episode's reward: the sum of its step rewards, or the last one.")
    sessions: int = Field(
        16, ge=1, description="A started server's concurrent episodes (an environment not "
        "marked SUPPORTS_CONCURRENT_SESSIONS gets 1); more wait for a free session.")
    timeout_s: float = Field(300.0, gt=0, description="Seconds for the server to answer a "
                             "reset or a step (and to accept a connection).")
    start_timeout_s: float = Field(
        120.0, gt=0, description="Seconds for a started server to come up.")
    capacity_wait_s: float = Field(
        600.0, ge=0, description="Seconds an episode waits for a session of a full server.")

    def split_seeds(self, split: Split) -> range:
        if split == "train":
            return range(self.seed, self.seed + self.size)
        first = self.seed + EVAL_SEED_OFFSET if self.eval_seed is None else self.eval_seed
        return range(first, first + (self.size if self.eval_size is None else self.eval_size))


@dataclass(frozen=True)
class Target:
    """Where the server is: `url` (a running one) or `module:name` (started here)."""

    uri: str
    url: str | None = None
    import_path: str | None = None


def parse_uri(uri: str) -> tuple[Target, OpenEnvArgs]:
    if not uri.startswith(SCHEME):
        raise EnvironmentError(uri, f"an OpenEnv environment URI starts with {SCHEME}")
    rest = uri[len(SCHEME):].split("?", 1)[0]
    scheme = rest.split("://", 1)[0] if "://" in rest else ""
    if scheme in _URL_SCHEMES and rest.split("://", 1)[1].strip("/"):
        target = Target(uri, url=rest.rstrip("/"))
    elif _IMPORT_FORM.match(rest):
        target = Target(uri, import_path=rest)
    else:
        raise EnvironmentError(uri, "expected openenv://pkg.module:EnvClass (a server started "
                               "here) or openenv://http://host:port (a running server)")
    try:
        args = OpenEnvArgs(**query_args(uri))  # type: ignore[arg-type]  # pydantic types them
    except ValidationError as e:
        raise EnvironmentError(uri, "bad arguments: " + "; ".join(
            _arg_error(err) for err in e.errors())) from None
    if args.adapter is not None and {"observation", "action", "system"} & set(query_args(uri)):
        raise EnvironmentError(uri, "?adapter= replaces ?observation=, ?action= and ?system=; "
                               "give one or the other")
    return target, args


def _arg_error(err: Any) -> str:
    name = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"unknown argument ?{name}= (known: {', '.join(OpenEnvArgs.model_fields)})"
    return f"?{name}={err.get('input')!r}: {err['msg']}"


def ws_url(http_url: str) -> str:
    """The `/ws` endpoint of a server's base URL."""
    scheme, rest = http_url.split("://", 1)
    return f"{_URL_SCHEMES[scheme]}://{rest.rstrip('/')}/ws"


# -- observations to messages, replies to actions --------------------------------------------
@runtime_checkable
class EpisodeAdapter(Protocol):
    """How a text environment talks chat. `messages` gives the messages an observation adds
    to the conversation (turn 0: the reset's observation; never empty, or the model would be
    asked the same thing twice); `action` the action (a JSON object) for the model's reply."""

    def messages(self, observation: Mapping[str, Any], turn: int) -> list[dict[str, Any]]: ...

    def action(self, reply: str, observation: Mapping[str, Any]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class FieldAdapter:
    """The default: one observation field is the user's message, one action field the reply."""

    observation: str = "prompt"
    action_field: str = "message"
    system: str | None = None

    def messages(self, observation: Mapping[str, Any], turn: int) -> list[dict[str, Any]]:
        if self.observation not in observation:
            raise ValueError(f"the observation has no field {self.observation!r} (its fields: "
                             f"{sorted(observation)}): name its text field with ?observation=, "
                             "or give an ?adapter=")
        text = observation[self.observation]
        if not isinstance(text, str):
            raise ValueError(f"observation field {self.observation!r} is a "
                             f"{type(text).__name__}, not text: name a text field with "
                             "?observation=, or give an ?adapter=")
        opening = [{"role": "system", "content": self.system}] if turn == 0 and self.system else []
        return [*opening, {"role": "user", "content": text}]

    def action(self, reply: str, observation: Mapping[str, Any]) -> dict[str, Any]:
        return {self.action_field: reply}


def load_adapter(uri: str, args: OpenEnvArgs) -> EpisodeAdapter:
    if args.adapter is None:
        return FieldAdapter(args.observation, args.action, args.system)
    module, name = args.adapter.split(":", 1) if ":" in args.adapter else ("", args.adapter)
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, ValueError, AttributeError) as e:
        raise EnvironmentError(uri, f"?adapter={args.adapter}: cannot import it: {e}") from None
    adapter = obj() if isinstance(obj, type) else obj
    if not isinstance(adapter, EpisodeAdapter):
        raise EnvironmentError(uri, f"?adapter={args.adapter}: needs messages(observation, "
                               "turn) and action(reply, observation) (EpisodeAdapter)")
    return adapter


# -- one episode -----------------------------------------------------------------------------
@dataclass(frozen=True)
class StepReply:
    """What a reset or a step answers: the observation's own fields, reward and done."""

    observation: dict[str, Any]
    reward: float | None
    done: bool


class EnvSession(Protocol):
    async def reset(self, seed: int) -> StepReply: ...

    async def step(self, action: dict[str, Any], turn: int) -> StepReply: ...


async def play(uri: str, llm: Any, env: EnvSession, adapter: EpisodeAdapter, args: OpenEnvArgs,
               seed: int) -> EpisodeResult:
    """reset(seed) → (observation → messages → model reply → action → step) until the
    environment is done, `max_turns` replies, or the gateway stops answering (the step's
    abort, the sample's token budget spent). `llm` is an `openai.AsyncOpenAI`."""
    reply = await env.reset(seed)
    if reply.done:
        raise EnvironmentError(uri, f"the episode of seed {seed} was done at reset: nothing for "
                               "the model to do")
    messages: list[dict[str, Any]] = []
    rewards: list[float] = []
    limit = {"max_tokens": args.max_tokens} if args.max_tokens else {}
    for turn in range(args.max_turns):
        try:
            new = adapter.messages(reply.observation, turn)
            if not new or not all(isinstance(m, dict) and "role" in m for m in new):
                raise ValueError(f"messages() gave {new!r}: needs a non-empty list of chat "
                                 "messages")
        except Exception as e:
            raise EnvironmentError(uri, f"seed {seed}, turn {turn}: {e}") from None
        messages.extend(new)
        completion = await llm.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                       **limit)
        choice = completion.choices[0]
        text = choice.message.content or ""
        spent = completion.usage is not None and completion.usage.completion_tokens == 0
        if choice.finish_reason == "abort" or (choice.finish_reason == "length" and spent):
            break  # the step is over (the sample goes back aborted) or its budget is spent
        messages.append({"role": "assistant", "content": text})
        try:
            action = adapter.action(text, reply.observation)
            if not isinstance(action, dict):
                raise ValueError(f"action() gave a {type(action).__name__}, not a JSON object")
        except Exception as e:
            raise EnvironmentError(uri, f"seed {seed}, turn {turn}: {e}") from None
        reply = await env.step(action, turn)
        rewards.append(float(reply.reward or 0.0))
        if reply.done:
            break
    metrics = {"env_steps": float(len(rewards)), "env_done": float(reply.done),
               **{f"step_{i}_reward": r for i, r in enumerate(rewards)}}
    if args.reward == "last":
        return EpisodeResult(rewards[-1] if rewards else 0.0, metrics)
    return EpisodeResult(sum(rewards), metrics)


class WebSocketSession:
    """One episode's session on an OpenEnv server (its `/ws` endpoint). A full server (every
    session taken) is asked again, with backoff, for up to `capacity_wait_s`; a server of ours
    found dead when connecting (before anything was played) is started again, once."""

    def __init__(self, uri: str, server: Server, args: OpenEnvArgs) -> None:
        self.uri, self.server, self.args = uri, server, args
        self.url = ""
        self.seed = -1
        self._ws: Any = None

    async def reset(self, seed: int) -> StepReply:
        self.seed = seed
        deadline = time.monotonic() + self.args.capacity_wait_s
        delay = 0.05
        while True:
            await self._connect()
            try:
                return await self._call({"type": "reset", "data": {"seed": seed}}, "reset")
            except _Full as full:
                await self.close()
                if time.monotonic() + delay > deadline:
                    raise EnvironmentError(self.uri, f"the server at {self.url} had no free "
                                           f"session for {self.args.capacity_wait_s:g} s "
                                           f"({full}); raise its max_concurrent_envs") from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def step(self, action: dict[str, Any], turn: int) -> StepReply:
        return await self._call({"type": "step", "data": action}, f"step {turn}", action)

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            # the server closes the connection when asked; closing it from here first makes
            # the server's own close raise (and log a traceback)
            with contextlib.suppress(Exception):
                await ws.send(json.dumps({"type": "close"}))
                async with asyncio.timeout(5):
                    await ws.wait_closed()
            with contextlib.suppress(Exception):
                await ws.close()

    async def __aenter__(self) -> WebSocketSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _connect(self) -> None:
        from websockets.asyncio.client import connect

        for attempt in (1, 2):
            url = self.server.url()
            self.url = url if url is not None else await asyncio.to_thread(self.server.start)
            try:
                self._ws = await connect(ws_url(self.url), open_timeout=self.args.timeout_s,
                                         max_size=None, proxy=None)
                return
            except Exception as e:
                why = await self._why()
                if attempt == 2 or not why:
                    raise EnvironmentError(self.uri, f"cannot reach the OpenEnv server at "
                                           f"{self.url} (episode of seed {self.seed}): "
                                           f"{e!r}{why}") from None

    async def _call(self, message: dict[str, Any], what: str,
                    action: dict[str, Any] | None = None) -> StepReply:
        from websockets.exceptions import ConnectionClosed

        where = f"{what} of the episode of seed {self.seed}"
        try:
            # a server that refuses the session (full) answers, then closes: the send may
            # fail, the answer is still there to read
            with contextlib.suppress(ConnectionClosed):
                await self._ws.send(json.dumps(message))
            async with asyncio.timeout(self.args.timeout_s):
                raw = await self._ws.recv()
        except ConnectionClosed as e:
            raise EnvironmentError(self.uri, f"the OpenEnv server at {self.url} closed the "
                                   f"connection during the {where} ({e}){await self._why()}"
                                   ) from None
        except TimeoutError:
            raise EnvironmentError(self.uri, f"the OpenEnv server at {self.url} did not answer "
                                   f"the {where} within {self.args.timeout_s:g} s") from None
        answer = json.loads(raw)
        data = answer.get("data") or {}
        if answer.get("type") == "error":
            code = str(data.get("code", "UNKNOWN"))
            if code == "CAPACITY_REACHED" and what == "reset":
                raise _Full(str(data.get("message", "")))
            detail = f": {json.dumps(data['errors'], default=str)[:500]}" if "errors" in data else ""
            hint = (f" (the action was {json.dumps(action)[:200]}: name the environment's text "
                    "field with ?action=, or give an ?adapter=)") if code == "VALIDATION_ERROR" \
                and action is not None else ""
            raise EnvironmentError(self.uri, f"the server refused the {where}: {code} "
                                   f"{data.get('message', '')}{detail}{hint}")
        if answer.get("type") != "observation" or not isinstance(data.get("observation"), dict):
            raise EnvironmentError(self.uri, f"the server answered the {where} with "
                                   f"{str(raw)[:200]!r}, not an observation")
        reward = data.get("reward")
        return StepReply(data["observation"], None if reward is None else float(reward),
                         bool(data.get("done", False)))

    async def _why(self) -> str:
        why = await asyncio.to_thread(self.server.exit_report)
        return f"; {why}" if why else ""


class _Full(Exception):
    """The server has no free session (CAPACITY_REACHED)."""


# -- the environment -------------------------------------------------------------------------
class OpenEnvEnvironment:
    """An OpenEnv server's episodes as rollflow tasks (engines.environments.base.Environment)."""

    def __init__(self, target: Target, args: OpenEnvArgs, adapter: EpisodeAdapter) -> None:
        self.uri = target.uri
        self.args, self.adapter = args, adapter
        self.server: Server = (
            RunningServer(target.url) if target.url is not None
            else LocalServer(target.uri, str(target.import_path), args.sessions,
                             args.start_timeout_s))

    def tasks(self, split: Split) -> Sequence[EnvironmentTask]:
        return [EnvironmentTask(f"openenv episode seed={s}", None, {"seed": s})
                for s in self.args.split_seeds(split)]

    async def run_episode(self, base_url: str, task: EnvironmentTask, seed: int) -> EpisodeResult:
        """The episode of `task`'s reset seed; `seed` (the sample's) is unused: the episode
        is the task's, and the model's sampling seeds are the gateway's."""
        try:
            env_seed = int(task.data["seed"])
        except (KeyError, TypeError, ValueError):
            raise EnvironmentError(self.uri, f"task {task.to_json()} has no integer "
                                   "data.seed") from None
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0,
                               timeout=3600.0) as llm, \
                WebSocketSession(self.uri, self.server, self.args) as env:
            return await play(self.uri, llm, env, self.adapter, self.args, env_seed)

    def close(self) -> None:
        self.server.stop()


def open_openenv_environment(uri: str) -> OpenEnvEnvironment:
    """The environment `uri` names; nothing starts until its first episode."""
    target, args = parse_uri(uri)
    needed = ["websockets", "openai"] + (["openenv", "uvicorn"] if target.url is None else [])
    missing = [m for m in needed if importlib.util.find_spec(m) is None]
    if missing:
        raise EnvironmentError(uri, f"{', '.join(missing)} not installed: {INSTALL_HINT}")
    return OpenEnvEnvironment(target, args, load_adapter(uri, args))
