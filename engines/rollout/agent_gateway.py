"""A token-capturing OpenAI endpoint for agents: the agent talks chat, the sample gets tokens.

```
 agent (openai client) ──POST {base}/s/{session}/v1/chat/completions──► AgentGateway
                                                                         │ messages → prompt ids
                                                                         │ (exact tokens so far
                                                                         │  + the new messages)
   ◄── OpenAI chat completion (content, tool_calls, logprobs, token ids) ◄─┤
                                                                         ▼
                                             engine or router /generate(input_ids, seed, budget)
```
Each sample of an agent rollout gets a session (its base URL carries it, and it is also the
API key). The gateway never re-tokenizes what the model generated: the sample is the exact
prompt ids of the first turn, then per turn the new messages' tokens (loss mask 0, log-prob
0.0) and the engine's output ids (loss mask 1, the engine's log-probs). A turn's new tokens
come from the chat template rendered over the *new* messages only, after the closing the
template puts behind an assistant turn. If the agent sends a history that is not the one the
session recorded (it rewrote or dropped turns), the sample restarts from that history's full
rendering with the earlier model tokens out of the loss, and the split is counted
(`rollout/token_drift_turns`, `rollout/token_drift_tokens`); how often a full re-rendering
would have changed the recorded tokens is counted too (`rollout/retokenize_mismatch_turns`),
which is the drift a gateway that re-tokenizes would have trained on.

Sampling is the rollout's: temperature, top-p and top-k come from the rollout config, each
turn's seed is `sampling_seed + turn * stride`, and the sample's token budget (tool tokens
included) caps `max_tokens`. An aborted turn (end of step, weight update) answers
`finish_reason: "abort"` and every later call of that session does too.
"""

from __future__ import annotations

import inspect
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from engines.chat import openai_shapes as shapes
from engines.chat.template import encode_text, normalise_messages, render_text
from engines.chat.tool_calls import ToolCall, offered_tool_names, parse_tool_calls
from engines.hooks.protocols import AgentFn, GenerateFn, engine_url
from engines.rollout.sglang_client import GenerateOutput, SGLangClient
from storage.sample import UNKNOWN_VERSION, Sample, Status

log = logging.getLogger(__name__)

SEED_STRIDE = 1_000_003  # each turn samples with its own seed
# sample.metadata keys: counts the generation loop sums into rollout/{key} metrics, and the
# flag of a reward the agent gave (the rollout's reward function leaves it alone)
AGENT_COUNTERS = ("agent_turns", "token_drift_turns", "token_drift_tokens",
                  "retokenize_mismatch_turns", "agent_replayed_turns", "agent_replay_mismatch")
AGENT_REWARD = "agent_reward"
RECORD = "agent_record"  # [[prompt_end, output_end, finish_reason, text, weight_version], ...]
_FINISH = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
_MARK = "\u2063rollflow-content\u2063"  # text no template changes, to find an assistant turn's closing
_BASE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def _same_message(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal as the template sees them (content None and "" alike; tool call ids ignored)."""
    def key(m: dict[str, Any]) -> tuple[Any, ...]:
        calls = [(c["function"]["name"], orjson.dumps(c["function"]["arguments"],
                                                      option=orjson.OPT_SORT_KEYS))
                 for c in m.get("tool_calls") or []]
        return m["role"], m.get("content") or "", calls
    return key(a) == key(b)


class ChatRenderer:
    """Token ids of new messages appended to a recorded conversation, template-exact."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        with_mark = render_text(tokenizer, [_BASE[0], {"role": "assistant", "content": _MARK}],
                                add_generation_prompt=False)
        self.closing = with_mark[with_mark.index(_MARK) + len(_MARK):]
        eos = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([eos], skip_special_tokens=False) if eos is not None else ""

    def closing_ids(self, output_ids: list[int]) -> list[int]:
        """What the template puts after an assistant turn that the model did not write."""
        rest = self.closing
        if output_ids and output_ids[-1] == self.tokenizer.eos_token_id and \
                rest.startswith(self.eos_text):
            rest = rest[len(self.eos_text):]
        return encode_text(self.tokenizer, rest) if rest else []

    def new_message_ids(self, messages: list[dict[str, Any]], tools: Any) -> list[int] | None:
        """The new messages plus the generation prompt, rendered after a fixed history
        (None: the template renders them differently in front of another history)."""
        before = render_text(self.tokenizer, _BASE, tools, add_generation_prompt=False)
        after = render_text(self.tokenizer, [*_BASE, *messages], tools)
        if not after.startswith(before):
            return None
        return encode_text(self.tokenizer, after[len(before):])

    def full_ids(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        return encode_text(self.tokenizer, render_text(self.tokenizer, messages, tools))


@dataclass(frozen=True, slots=True)
class RecordedTurn:
    """Where one model turn sits in `sample.tokens`, and how the engine ended it."""

    prompt_end: int
    output_end: int
    finish: dict[str, Any]
    text: str
    weight_version: int


@dataclass(frozen=True)
class Replay:
    """An aborted agent sample as it was, so its rerun gets the same answers back.

    The agent cannot resume mid-conversation (its state is gone), so it runs again from
    the start; each call whose prompt is the recorded one is answered from the record
    without the engine, and the aborted last turn continues from its partial output, as
    slime's partial rollouts continue a plain sample. A call that differs (the agent is
    not deterministic) ends the replay and generates afresh, counted."""

    tokens: list[int]
    prompt_length: int
    loss_mask: list[int]
    log_probs: list[float]
    turns: list[RecordedTurn]

    @classmethod
    def take(cls, sample: Sample) -> Replay | None:
        """The partial sample's record (None for a fresh one); the sample is reset to its
        prompt either way."""
        record = sample.metadata.pop(RECORD, None)
        replay = None
        if sample.response_length and record:
            replay = cls(list(sample.tokens), sample.prompt_length, list(sample.loss_mask),
                         list(sample.rollout_log_probs), [RecordedTurn(*t) for t in record])
        del sample.tokens[sample.prompt_length:]
        sample.response, sample.response_length = "", 0
        sample.loss_mask, sample.rollout_log_probs, sample.token_versions = [], [], []
        return replay

    def turn(self, index: int, prompt: list[int]) -> RecordedTurn | None:
        if index >= len(self.turns) or prompt != self.tokens[: self.turns[index].prompt_end]:
            return None
        return self.turns[index]

    def output(self, turn: RecordedTurn) -> tuple[list[int], list[float], list[int]]:
        """(token ids, log-probs, loss mask) the turn recorded."""
        lo, hi = turn.prompt_end - self.prompt_length, turn.output_end - self.prompt_length
        return (self.tokens[turn.prompt_end: turn.output_end], self.log_probs[lo:hi],
                self.loss_mask[lo:hi])


@dataclass
class Session:
    """One sample's conversation as the engine saw it."""

    key: str
    sample: Sample
    sampling_params: dict[str, Any]
    budget: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    last_output: list[int] = field(default_factory=list)
    turn: int = 0
    aborted: bool = False
    replay: Replay | None = None
    record: list[list[Any]] = field(default_factory=list)

    def count(self, name: str, by: int = 1) -> None:
        self.sample.metadata[name] = int(self.sample.metadata.get(name, 0)) + by


def _append(sample: Sample, ids: list[int], logprobs: list[float], text: str, mask: int) -> None:
    sample.tokens.extend(ids)
    sample.response += text
    sample.response_length += len(ids)
    sample.loss_mask.extend([mask] * len(ids))
    sample.rollout_log_probs.extend(logprobs)
    sample.token_versions.extend([UNKNOWN_VERSION] * len(ids))  # not the model's tokens


class AgentGateway:
    """An aiohttp server on the rollout's event loop for the duration of one generation."""

    def __init__(self, args: Any, tokenizer: Any, host: str = "127.0.0.1") -> None:
        if tokenizer is None:
            raise ValueError("rollout.agent_path needs a tokenizer (engine.model_path)")
        self.args = args
        self.renderer = ChatRenderer(tokenizer)
        self.tokenizer = tokenizer
        self.host = host
        self.sessions: dict[str, Session] = {}
        self._clients: dict[str, SGLangClient] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/s/{session}/v1/chat/completions", self._chat)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/s/{session}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        if self._runner is not None:
            await self._runner.cleanup()

    def base_url(self, key: str) -> str:
        return f"http://{self.host}:{self.port}/s/{key}/v1"

    def generate_fn(self, agent: AgentFn) -> GenerateFn:
        """The generation loop's custom generate function: one agent run per sample."""
        async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
            return await self.run_sample(agent, sample, sampling_params)
        return generate

    # -- one sample ----------------------------------------------------------------------
    async def run_sample(
        self, agent: AgentFn, sample: Sample, sampling_params: dict[str, Any]
    ) -> Sample:
        """Run the agent on one sample: its calls fill the sample; its return is the reward
        (a number or dict), the sample itself, or None (the reward function scores it)."""
        # the loop hands a partial sample the budget it has left; the rerun starts over
        budget = int(sampling_params["max_new_tokens"]) + sample.response_length
        replay = Replay.take(sample)
        key = f"{secrets.token_hex(6)}-{sample.index}"
        session = Session(key, sample, sampling_params, budget, replay=replay)
        self.sessions[key] = session
        sample.status = Status.PENDING
        try:
            result = await _call_agent(agent, self.base_url(key), sample, key, sampling_params,
                                       self.args)
        except Exception as err:  # the agent's bug fails its sample, not the step
            log.warning("agent failed on sample %d: %r", sample.index, err)
            sample.status, sample.reward = Status.FAILED, 0.0
            sample.metadata["agent_error"] = repr(err)[:500]
            sample.metadata[AGENT_REWARD] = True
            return sample
        finally:
            del self.sessions[key]
        if session.turn == 0 and not session.aborted:
            sample.status = Status.FAILED
            sample.metadata["agent_error"] = "the agent made no chat completion call"
        if isinstance(result, Sample) and result is not sample:
            raise TypeError(f"rollout.agent_path returned another Sample for sample {sample.index}")
        if isinstance(result, int | float | dict) and not isinstance(result, bool):
            sample.reward = float(result) if isinstance(result, int | float) else result
            sample.metadata[AGENT_REWARD] = True
        sample.metadata["agent_turns"] = session.turn
        sample.check()
        return sample

    # -- HTTP ------------------------------------------------------------------------------
    def _session(self, request: web.Request) -> Session | None:
        key = request.match_info.get("session")
        if key is None:
            auth = request.headers.get("Authorization", "")
            key = auth.removeprefix("Bearer ").strip()
        return self.sessions.get(key)

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": "policy", "object": "model", "created": 0, "owned_by": "rollflow"}
        return web.json_response({"object": "list", "data": [card]})

    async def _chat(self, request: web.Request) -> web.Response:
        session = self._session(request)
        if session is None:
            return _error("no agent session with this URL or API key (has the sample "
                          "finished?)", 401)
        try:
            body = orjson.loads(await request.read())
            if not isinstance(body, dict):
                raise ValueError("request body must be a JSON object")
            if body.get("n", 1) != 1 or body.get("stream"):
                raise ValueError("the agent gateway answers n=1, stream=false requests")
            messages = normalise_messages(body.get("messages"))
            names = offered_tool_names(body.get("tools"), body.get("tool_choice", "auto"))
            prompt = self._prompt(session, messages, body.get("tools"))
        except ValueError as err:
            return _error(str(err), 400)
        out, mask = await self._generate(session, prompt, body)
        content, calls = parse_tool_calls(out.text, names) if names else (out.text, [])
        self._record(session, messages, content, calls, out, mask)
        done = shapes.Finished(f"sample-{session.sample.index}-turn-{session.turn - 1}",
                               prompt, list(out.output_ids), list(out.log_probs), out.text,
                               out.finish_reason)
        choice = shapes.chat_choice(0, done, content, calls, self.tokenizer,
                                    bool(body.get("logprobs")), bool(body.get("return_token_ids")),
                                    bool(body.get("return_prompt_token_ids")))
        reply = shapes.response(f"chatcmpl-{done.request_id}", "chat.completion",
                                str(body.get("model") or "policy"), [choice], len(prompt),
                                len(out.output_ids))
        return web.Response(body=orjson.dumps(reply), content_type="application/json")

    # -- the token bookkeeping -------------------------------------------------------------
    def _prompt(self, s: Session, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        """Append this turn's new context tokens to the sample; return the full prompt."""
        sample = s.sample
        if s.turn == 0:
            ids = self.renderer.full_ids(messages, tools)
            sample.tokens[:] = ids
            return list(sample.tokens)
        recorded = len(s.messages)
        continues = len(messages) > recorded and all(
            _same_message(a, b) for a, b in zip(messages, s.messages, strict=False))
        new_ids = self.renderer.new_message_ids(messages[recorded:], tools) if continues else None
        if new_ids is None:
            self._split(s, messages, tools)
            return list(sample.tokens)
        env = self.renderer.closing_ids(s.last_output) + new_ids
        env = env[: max(s.budget - sample.response_length, 0)]
        _append(sample, env, [0.0] * len(env), self.tokenizer.decode(env), 0)
        if self.renderer.full_ids(messages, tools) != sample.tokens:
            s.count("retokenize_mismatch_turns")
        return list(sample.tokens)

    def _split(self, s: Session, messages: list[dict[str, Any]], tools: Any) -> None:
        """The agent's history is not the recorded one: restart the sample from it."""
        sample = s.sample
        s.count("token_drift_turns")
        s.count("token_drift_tokens", sum(sample.loss_mask))
        s.record.clear()
        s.replay = None
        sample.tokens[:] = self.renderer.full_ids(messages, tools)
        sample.response, sample.response_length = "", 0
        sample.loss_mask, sample.rollout_log_probs, sample.token_versions = [], [], []

    async def _generate(
        self, s: Session, prompt: list[int], body: dict[str, Any]
    ) -> tuple[GenerateOutput, list[int]]:
        """This turn's output and its loss mask: recorded (a replayed turn), continued (the
        aborted turn of a replay) or generated."""
        budget = s.budget - s.sample.response_length
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        limit = min(int(asked), budget) if asked else budget
        if s.aborted or budget <= 0:
            kind = "abort" if s.aborted else "length"
            return GenerateOutput([], "", [], {"type": kind}, s.sample.weight_version), []
        turn = s.replay.turn(s.turn, prompt) if s.replay else None
        if s.replay and turn is None:
            s.count("agent_replay_mismatch")
            s.replay = None
        if s.replay is None or turn is None:
            out = await self._engine(s, prompt, body, limit)
            return out, [1] * len(out.output_ids)
        ids, logprobs, mask = s.replay.output(turn)
        s.count("agent_replayed_turns")
        if turn.finish.get("type") != "abort" or len(ids) >= limit:
            return GenerateOutput(ids, turn.text, logprobs, turn.finish, turn.weight_version), mask
        rest = await self._engine(s, prompt + ids, body, limit - len(ids))
        return GenerateOutput(ids + list(rest.output_ids), turn.text + rest.text,
                              logprobs + list(rest.log_probs), rest.finish_reason,
                              rest.weight_version), mask + [1] * len(rest.output_ids)

    async def _engine(
        self, s: Session, prompt: list[int], body: dict[str, Any], max_new_tokens: int
    ) -> GenerateOutput:
        base = s.sampling_params
        stop = body.get("stop") or []
        params = {
            **base,
            "max_new_tokens": max_new_tokens,
            "stop": [*base.get("stop", []), *([stop] if isinstance(stop, str) else stop)],
            "sampling_seed": int(base.get("sampling_seed", 0)) + SEED_STRIDE * s.turn,
        }
        url = engine_url(self.args, s.sample)
        client = self._clients.get(url) or self._clients.setdefault(url, SGLangClient(url))
        return await client.generate(list(prompt), params,
                                     rid=f"sample-{s.sample.index}-turn-{s.turn}")

    def _record(self, s: Session, messages: list[dict[str, Any]], content: str | None,
                calls: list[ToolCall], out: GenerateOutput, mask: list[int]) -> None:
        sample = s.sample
        start = len(sample.tokens)
        sample.tokens.extend(out.output_ids)
        sample.response += out.text
        sample.response_length += len(out.output_ids)
        sample.loss_mask.extend(mask)
        sample.rollout_log_probs.extend(out.log_probs)
        sample.token_versions.extend(out.token_versions
                                     or [out.weight_version] * len(out.output_ids))
        s.record.append([start, len(sample.tokens), dict(out.finish_reason), out.text,
                         out.weight_version])
        sample.metadata[RECORD] = s.record
        sample.status = _FINISH.get(str(out.finish_reason.get("type")), Status.FAILED)
        sample.weight_version = out.weight_version
        sample.metadata.setdefault("start_weight_version", out.weight_version)
        s.aborted = s.aborted or sample.status == Status.ABORTED
        assistant: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            assistant["tool_calls"] = [{"function": {"name": c.name,
                                                     "arguments": orjson.loads(c.arguments)}}
                                       for c in calls]
        s.messages = [*messages, assistant]
        s.last_output = list(out.output_ids)
        s.turn += 1


def _error(message: str, status: int) -> web.Response:
    return web.Response(body=orjson.dumps({"error": shapes.error_body(message, status)}),
                        status=status, content_type="application/json")


async def _call_agent(agent: AgentFn, base_url: str, sample: Sample, key: str,
                      sampling_params: dict[str, Any], args: Any) -> Any:
    """`agent(base_url, sample, api_key=..., sampling_params=..., args=...)`, passing only
    the keywords the agent's signature takes."""
    offered = {"api_key": key, "sampling_params": sampling_params, "args": args}
    params = inspect.signature(agent).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return await agent(base_url, sample, **offered)
    return await agent(base_url, sample, **{k: v for k, v in offered.items() if k in params})

