"""Every fake of the tests, in one place. Stand-ins for the Ray actors a rollout step talks
to, so the step tasks' logic runs through `task.fn(...)` without Ray or Prefect.

The step tasks and the engine pool collect what actor calls return through a `Replies`
(engines/cluster/engine_pool.py): `ray.get` / `ray.wait` in a run. A fake's `.remote()`
returns the value itself, and `InProcessReplies` collects it as it is, so no Ray is needed
at all. Storage stays real (a `RunLayout` in a temporary directory), as does the config.

- `remote`: decorator that makes a fake's method callable as `fake.method.remote(...)`
  (returning the result at once) as well as directly.
- `InProcessReplies`: the `Replies` of actors called in this process: every call is done,
  its reply is its value.
- `FakeRollout`: the rollout actor (`RolloutManager`): `sample_prompts`, `generate`, `filter`,
  `reward`, `evaluate` return fixed records of a step of `groups` groups x `n` samples.
- `FakeTrainer`: the trainer (`TrainActor` / `TrainGroup`): a weight version that
  `train_step(k)` moves to k + 1 (`{"skipped": 1.0}` when already past k), `version`,
  `ensure_version`, `save_checkpoint`, `weights`, `push_weights` (`push_timings`: its
  `timings`), `offload`, `onload`.
- `FakeEngine`: an engine actor: `weight_version`, `url`, `update_weights_from_tensor`.
- `fake_actors(...)`: a `RunActors` of one FakeRollout, one FakeTrainer and FakeEngines.
- `step_context(root, *overrides)`: a `StepContext` over fake actors (`InProcessReplies`), a
  real config (mock backends; `--set`-style overrides) and a real run directory under `root`.

- `FakeModel`, `fake_train_step(model, algo, **train)`: a model-free `StepModel` for the
  shared train step (engines/train/step.py), recording every call.

- `InProcess(obj)`: a real actor object called as an actor (`.method.remote(...)` returns the
  result at once), for the step tasks over real actors without Ray.
- `FakeProgressArtifact`: Prefect's progress artifact, kept in memory (no API server).
- `CharTokenizer`: a tokenizer of one id per character, with a plain chat template.
- `CountingStore`, `FullDiskStore`: object stores that record each download (one file per
  torch.distributed rank) / fail their first upload, as a full disk does.
- `ExportingBackend`: a train backend whose weight export counts its (collective) calls.
- `RecordingEngine`: an engine over real HTTP that records each `/update_weights_from_tensor`.
- `RewardServer`: a real HTTP reward model that can fail or be slow.

Each actor fake appends `(method, args)` to its `calls`, so a test can check what was (not) asked.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engines.cluster.actors import RunActors
from engines.cluster.engine_pool import Replies
from engines.config.algorithm import AlgorithmConfig
from engines.config.train import TrainConfig
from engines.records import FilterRecord, GenerateRecord, RewardRecord, SamplePromptsRecord
from engines.train.batching import build_padded_batch
from engines.train.step import TrainStep
from engines.train.step_model import PREFIX, Forward, MicroBatch, MicroBatchLoss, Part, Role
from flows.config.loader import apply_overrides, config_from_dict
from storage.object_store import ObjectStore
from storage.run_layout import RunLayout
from storage.sample import Sample
from tasks.step_context import StepContext


class remote:  # noqa: N801 - used as a decorator, like ray.remote
    """`fake.method(...)` and `fake.method.remote(...)` both call the method; each call is
    logged in the fake's `calls`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self

        def call(*args: Any) -> Any:
            obj.calls.append((self.fn.__name__, args))
            return self.fn(obj, *args)

        return _Method(call)


class _Method:
    def __init__(self, call: Callable[..., Any]) -> None:
        self.remote = call

    def __call__(self, *args: Any) -> Any:
        return self.remote(*args)


class InProcessReplies:
    """Replies of actors called in this process (the fakes, `InProcess`): a call's reply is its
    value, and every call is done by the time it returns."""

    def get(self, refs: Any) -> Any:
        return refs

    def answered(self, refs: Sequence[Any], timeout_s: float) -> list[bool]:
        return [True] * len(refs)


IN_PROCESS: Replies = InProcessReplies()


class InProcess:
    """A real actor's object in this process, called as the tasks call an actor:
    `obj.method.remote(...)` runs the method and returns its result."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self.obj, name))


class FakeProgressArtifact:
    """Stands in for tasks.artifacts.ProgressArtifact: what it would show, in `shown`."""

    def __init__(self, key: str, description: str) -> None:
        self.key = key
        self.shown: list[float] = []

    def set(self, percent: float) -> None:
        self.shown.append(percent)


class FakeRollout:
    def __init__(self, groups: int = 2, n: int = 2) -> None:
        self.groups, self.n = groups, n
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    @remote
    def sample_prompts(self, rollout_id: int) -> SamplePromptsRecord:
        return SamplePromptsRecord(uri=f"mem://steps/{rollout_id:06d}/prompts.arrow",
                                   groups=self.groups, epoch=0)

    @remote
    def generate(self, rollout_id: int) -> GenerateRecord:
        return GenerateRecord(
            uri=f"mem://steps/{rollout_id:06d}/rollout.arrow", groups=self.groups,
            extra_draws=0, buffer_groups=1,
            rollout_metrics={"rollout/groups_kept": float(self.groups),
                             "rollout/response_len_mean": 3.5},
        )

    @remote
    def filter(self, rollout_id: int) -> FilterRecord:
        first = rollout_id * self.groups
        return FilterRecord(kept_groups=tuple(range(first, first + self.groups)), failed=0,
                            over_sampling_dropped=0)

    @remote
    def reward(self, rollout_id: int, kept_groups: tuple[int, ...]) -> RewardRecord:
        return RewardRecord(uri=f"mem://steps/{rollout_id:06d}/train.arrow",
                            samples=len(kept_groups) * self.n, mean=0.5, std=0.5)

    @remote
    def evaluate(self, weight_version: int) -> dict[str, float]:
        return {"eval/arithmetic/accuracy": 0.25}


class FakeTrainer:
    def __init__(self, version: int = 0) -> None:
        self._version = version
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.timings: dict[str, float] = {}  # what push_timings reports

    @remote
    def version(self) -> int:
        return self._version

    @remote
    def train_step(self, rollout_id: int) -> dict[str, float]:
        if self._version > rollout_id:
            return {"skipped": 1.0}
        self._version = rollout_id + 1
        return {"loss": 0.25, "grad_norm": 1.5, "skipped": 0.0,
                "weight_version": float(self._version), "critic/value_loss": 0.125,
                "train/seconds": 0.001}

    @remote
    def ensure_version(self, target: int) -> dict[str, Any]:
        return {"rebuilt": False, "version": self._version, "replayed": []}

    @remote
    def save_checkpoint(self, rollout_id: int) -> str:
        return f"mem://checkpoints/{rollout_id:06d}"

    @remote
    def weights(self) -> dict[str, Any]:
        return {"version": self._version}

    @remote
    def push_weights(self, engine_urls: list[str]) -> list[int]:
        return [self._version] * len(engine_urls)

    @remote
    def push_timings(self) -> dict[str, float]:
        return dict(self.timings)

    @remote
    def sends_cuda_ipc(self) -> bool:
        return False

    @remote
    def offload(self) -> None:
        pass

    @remote
    def onload(self) -> None:
        pass


class FakeEngine:
    def __init__(self, index: int = 0, version: int = 0, exports: bool = True) -> None:
        self.index, self._version, self._exports = index, version, exports
        self.address = f"http://127.0.0.1:{30000 + index}"
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.weights_from: dict[str, Any] | None = None  # the last state dict it loaded

    @remote
    def exports_weights(self) -> bool:
        return self._exports

    @remote
    def weights(self) -> dict[str, Any]:
        return {"engine": self.index, "version": self._version}

    @remote
    def weight_version(self) -> int:
        return self._version

    @remote
    def url(self) -> str:
        return self.address

    @remote
    def update_weights_from_tensor(self, weights: dict[str, Any], version: int) -> int:
        self._version, self.weights_from = version, weights
        return version


def fake_actors(engine_versions: tuple[int, ...] = (0,), trainer_version: int = 0) -> RunActors:
    engines = [FakeEngine(i, v) for i, v in enumerate(engine_versions)]
    return RunActors(rollout=FakeRollout(), trainer=FakeTrainer(trainer_version),
                     engines=engines, urls=[e.address for e in engines])


def step_context(root: Path, *overrides: str, actors: RunActors | None = None) -> StepContext:
    raw = {
        "data": {"prompt_data": "x.jsonl"},
        "rollout": {"num_rollout": 3, "rollout_batch_size": 2, "n_samples_per_prompt": 2},
        "train": {"backend": "mock"},
        "engine": {"backend": "mock"},
        "storage": {"uri": str(root), "run_name": "fake-run"},
    }
    cfg = config_from_dict(apply_overrides(raw, list(overrides)))
    layout = RunLayout.open(cfg.storage.uri, cfg.storage.run_name)
    return StepContext(cfg, layout, actors or fake_actors(), replies=IN_PROCESS)


class FakeModel:
    """A `StepModel` whose log-probs / values are a trainable scalar per part; it records
    every call, and skips the optimizer steps listed in `skip`."""

    def __init__(self, dp_rank: int = 0, dp_size: int = 1, skip: tuple[int, ...] = ()) -> None:
        self.version = 0
        self._rank, self._size, self.skip = dp_rank, dp_size, skip
        self.weights = {"actor": torch.zeros((), requires_grad=True),
                        "critic": torch.zeros((), requires_grad=True)}
        self.calls: list[tuple[str, list[MicroBatch]]] = []
        self.scored: list[tuple[str, int]] = []

    @property
    def dp_rank(self) -> int:
        return self._rank

    @property
    def dp_size(self) -> int:
        return self._size

    @property
    def lazy_old_log_probs(self) -> bool:
        return self._size == 1

    @property
    def shares_prompts(self) -> bool:
        return False

    def score(self, role: Role, samples: list[Sample]) -> list[Tensor]:
        self.scored.append((role, len(samples)))
        return [torch.full((s.response_length,), -1.0) for s in samples]

    def optimizer_step(self, part: Part, samples: list[Sample], micro_batches: list[MicroBatch],
                       loss_fn: MicroBatchLoss) -> dict[str, float]:
        self.calls.append((part, micro_batches))
        w, out = self.weights[part], {}
        for mb in micro_batches:
            batch = build_padded_batch([samples[i] for i in mb.rows])
            x = w.expand(batch.targets.shape) - 1.0
            fwd = (Forward(batch, values=x) if part == "critic"
                   else Forward(batch, log_probs=x, entropy=torch.zeros_like(x)))
            loss, terms = loss_fn(mb.rows, fwd)
            if mb.counted:
                out.update({PREFIX[part] + k: out.get(PREFIX[part] + k, 0.0) + float(v)
                            for k, v in terms.items()})
        skipped = len(self.calls) - 1 in self.skip
        if not skipped:
            out[PREFIX[part] + "grad_norm"] = 1.0
        out[PREFIX[part] + "skipped_steps"] = float(skipped)
        return out

    def check_weights_finite(self) -> None:
        pass


def fake_train_step(model: FakeModel, algo: dict[str, object] | None = None, **train: object) -> TrainStep:
    cfg = TrainConfig.model_validate({"max_tokens_per_micro_batch": 10**6, **train})
    return TrainStep(cfg, AlgorithmConfig.model_validate(algo or {}), model,
                     torch.Generator().manual_seed(0))


class CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"{m['role']}:{m['content']}|" for m in messages) + "assistant:"


class CountingStore(ObjectStore):
    """Records each download in `out` (one file per downloading rank)."""

    out: str = ""

    def get_dir(self, local_dir: str, *parts: str) -> str:
        with open(os.path.join(self.out, f"download-{dist.get_rank()}"), "w"):
            pass
        return super().get_dir(local_dir, *parts)


class FullDiskStore(ObjectStore):
    """Its first upload fails, as on a full disk or a dropped connection."""

    failed = False

    def put_dir(self, local_dir: str, *parts: str, move: bool = False) -> str:
        if not self.failed:
            self.failed = True
            raise OSError(28, "No space left on device")
        return super().put_dir(local_dir, *parts, move=move)


class ExportingBackend:
    """Stands in for megatron's: counts its (collective) exports, of `names`, each two
    floats of `fill` (a rank's marker, where a test gives each rank its own)."""

    version = 3

    def __init__(self, fill: float = 1.0, names: tuple[str, ...] = ("w",)) -> None:
        self.exports = 0
        self.fill, self.names = fill, names

    def export_weights(self) -> dict[str, torch.Tensor]:
        self.exports += 1
        return {name: torch.full((2,), self.fill) for name in self.names}

    def state_dict_for_engine(self) -> dict[str, torch.Tensor]:
        return self.export_weights()


class _JsonHandler(BaseHTTPRequestHandler):
    """A fake server's request handler: JSON answers, no access log."""

    def send_json(self, status: int, payload: dict[str, Any]) -> None:
        out = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a: Any) -> None:
        pass


class _LocalServer:
    """A fake's threaded HTTP server on 127.0.0.1, on a free port; `close()` stops it."""

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> int:
        """Serve `handler` in a daemon thread; returns the port."""
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        # polled every 50 ms, not 0.5 s: close() waits for the poll, once per test's server
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        return int(self.httpd.server_address[1])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class RecordingEngine(_LocalServer):
    """An SGLang server's weight-update routes over real HTTP, recording instead of loading:
    each `/update_weights_from_tensor` body lands in `tensor_updates`, and its
    `weight_version` is what `/get_weight_version` answers from then on. Pause, flush and
    continue answer `{}`; `/get_server_info` reports `tp_size` where one is given, as SGLang
    does."""

    def __init__(self, tp_size: int | None = None) -> None:
        self.tensor_updates: list[dict[str, Any]] = []
        self.version = "0"
        engine = self

        class Handler(_JsonHandler):
            def _answer(self, payload: dict[str, Any]) -> None:
                self.send_json(200, payload)

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path == "/update_weights_from_tensor":
                    engine.tensor_updates.append(body)
                    engine.version = body["weight_version"]
                    self._answer({"success": True, "message": "recorded"})
                else:
                    self._answer({})

            def do_GET(self) -> None:  # noqa: N802
                if self.path == "/get_server_info" and tp_size is not None:
                    self._answer({"tp_size": tp_size, "weight_version": engine.version})
                else:
                    self._answer({"weight_version": engine.version})

        self.url = f"http://127.0.0.1:{self._serve(Handler)}"


class RewardServer(_LocalServer):
    """A real HTTP reward model: fails the first `fail_first` requests (and every request
    while `down`) with `fail_status`, sleeps `delay_s` before answering, then scores
    `len(response)`."""

    def __init__(self, fail_first: int = 0, fail_status: int = 503, delay_s: float = 0.0):
        self.fail_first, self.fail_status, self.delay_s = fail_first, fail_status, delay_s
        self.requests: list[dict[str, Any]] = []
        self.down = False  # while set, every request gets `fail_status` (an outage)
        self.refused = 0
        server = self

        class Handler(_JsonHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                if server.down or len(server.requests) <= server.fail_first:
                    server.refused += 1
                    self.send_response(server.fail_status)
                    self.end_headers()
                    self.wfile.write(b"busy")
                    return
                time.sleep(server.delay_s)
                self.send_json(200, {"score": float(len(body["response"])), "ok": 1})

        self.url = f"http://127.0.0.1:{self._serve(Handler)}/score"


def judge_grade(response: str) -> str:
    """The fake judge's answer: the response is the score it gives (`7` -> `Score: 7`)."""
    return f"The response reads {response!r}, so.\nScore: {response}"


class JudgeServer(_LocalServer):
    """An OpenAI-compatible judge on 127.0.0.1: answers `/v1/chat/completions` and
    `/v1/completions` with `answer(user_text)`; fails the first `fail_first` requests with
    `fail_status`; records each request body and Authorization header, and the most
    requests it ever had in flight at once."""

    def __init__(self, answer: Callable[[str], str] = judge_grade, fail_first: int = 0,
                 fail_status: int = 503, delay_s: float = 0.0) -> None:
        self.answer, self.fail_first, self.fail_status = answer, fail_first, fail_status
        self.delay_s = delay_s
        self.requests: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.in_flight = self.max_in_flight = 0
        lock, server = threading.Lock(), self

        class Handler(_JsonHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    server.requests.append({"path": self.path, **body})
                    server.auth.append(self.headers.get("Authorization"))
                    failing = len(server.requests) <= server.fail_first
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                # out of flight before the answer is sent: a client that gets it may send its
                # next request at once, which must not find this one still counted (a loaded
                # machine descheduled this thread between the two, and the cap test saw 3)
                try:
                    time.sleep(server.delay_s)
                    status, payload = self.reply(body, failing)
                finally:
                    with lock:
                        server.in_flight -= 1
                self.send_json(status, payload)

            def reply(self, body: dict[str, Any], failing: bool) -> tuple[int, dict[str, Any]]:
                if failing:
                    return server.fail_status, {"error": "busy"}
                chat = self.path == "/v1/chat/completions"
                if not chat and self.path != "/v1/completions":
                    return 404, {"error": "no route"}
                text = server.answer(body["messages"][-1]["content"] if chat else body["prompt"])
                choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
                return 200, {"choices": [{"index": 0, **choice}]}


        self.base_url = f"http://127.0.0.1:{self._serve(Handler)}/v1"
