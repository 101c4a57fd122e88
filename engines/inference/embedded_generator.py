"""A transformers model that decodes like SGLang: continuous batching, KV-cached, exact log-probs.

The embedded engine lets the SGLang client, the router and the abort/partial-rollout path run
for real on CPU. Its log-probs must equal what the trainer recomputes (a plain full-sequence
forward), so rows are left-padded with an explicit attention mask *and* position ids
(`decode_batch`), and log-probs come from the untruncated float32 distribution (`sampling`).
Prefill is the HF forward; each decode step writes one column of a preallocated KV cache
(`kv_decode`), through a lean step where the model has a Llama layout (Llama, Qwen2, dense
Qwen3); on a GPU those steps run as replays of a captured CUDA graph (`cuda_graph_decode`).
For an MoE model it records the experts each fed token was routed to (`routed_experts`),
returned to requests that ask, as SGLang's `return_routed_experts`.
Batch-invariant (`batch_invariant`, engine.batch_invariant): prefill and decode both go
through the compiled step in its fixed-order mode (`kv_decode`), so a request's tokens and
log-probs do not depend on which requests shared its batch.

The engine holds no request state: the caller owns a `DecodeBatch` and calls `step` (admit
new requests, decode one token for the running ones), `abort` or `retract` on it. Weight
updates and memory release take the same lock, so they land between decode steps.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engines.inference import fp8, fused_decode
from engines.inference.cuda_graph_decode import CudaGraphTurns
from engines.inference.decode_batch import DecodeBatch, ReqState
from engines.inference.gen_types import (
    GeneratorIdentity,
    GenRequest,
    GenResult,
    ShouldAbort,
    finish_text,
    never_abort,
    run_to_completion,
)
from engines.inference.kv_decode import LlamaDecoder, make_decoder
from engines.inference.routed_experts import RoutingCapture
from engines.weights.model_families import check_model_config
from engines.weights.sync import weights_checksum

log = logging.getLogger(__name__)
# engine.dtype -> the dtype the model loads in (fp8: bfloat16, its projections then float8)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp8": torch.bfloat16}


def engine_device(choice: str) -> torch.device:
    """auto: the GPU this process sees (Ray gives an engine on a GPU bundle its own, as
    device 0), else the CPU."""
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("engine.device is 'cuda' but this engine's process sees no GPU")
    return torch.device("cuda", torch.cuda.current_device())
_ABORT = {"type": "abort", "message": "Abort before decoding finished."}
_PARALLEL_ELEMENTS = 4_096  # tokens x hidden size of a forward below which it uses one thread


@dataclass(frozen=True, slots=True)
class ReleasedWeights:
    """Where `release_memory` put the weights: a local file (CPU engines), or (`file` None)
    the pinned host buffers a GPU engine keeps between releases."""

    file: str | None


class EmbeddedGenerator(GeneratorIdentity):
    """An HF causal LM served with SGLang's sampling semantics; thread-safe.
    `continuous_steps`: tokens one `step` may decode (SGLang's `num_continuous_decode_steps`;
    the engine's config sets 8)."""

    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        max_batch_size: int = 1024,
        num_threads: int | None = None,
        seed: int = 0,
        device: str = "auto",
        continuous_steps: int = 1,
        batch_invariant: bool = False,
        cuda_graph: bool = True,
        torch_compile: bool = False,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self._threads = torch.get_num_threads()
        self.model_path = self.tokenizer_path = model_path
        self.max_batch_size = max_batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.device = engine_device(device)
        check_model_config(AutoConfig.from_pretrained(model_path), "embedded", model_path)
        self._load_dtype = _DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self._load_dtype)
        torch.nn.Module.to(self.model, self.device)  # transformers' typed `to` confuses mypy
        # engine.dtype fp8: the decoder layers' projections as float8 (`fp8.py`), which a
        # weight update quantizes again
        self._fp8 = fp8.quantize_model(self.model) if dtype == "fp8" else {}
        self.model.eval().requires_grad_(False)
        self.batch_invariant = batch_invariant
        self.cuda_graph = cuda_graph
        self.torch_compile = torch_compile
        self._make_decoder()
        if batch_invariant and not self._invariant_decoder():
            log.warning("engine.batch_invariant: %s is not a float32 Llama-layout model on a CPU "
                        "with the compiled decode step; its log-probs still depend on which "
                        "requests share a batch", model_path)
        self._routing = RoutingCapture.of(self.model)  # MoE models only
        self._fused = fused_decode.load() if self.device.type == "cpu" else None
        self.continuous_steps = continuous_steps
        self.context_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.vocab_size = int(self.model.config.vocab_size)
        self._hidden = int(getattr(self.model.config, "hidden_size", 0) or 1024)
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        gen_eos = gen_eos if isinstance(gen_eos, list) else [gen_eos]
        self.eos_ids = sorted({i for i in [self.tokenizer.eos_token_id, *gen_eos] if i is not None})
        self._pad_id = self.tokenizer.pad_token_id or 0
        self._rng = torch.Generator().manual_seed(seed)
        self._lock = threading.RLock()
        self._version = 0
        self._released: ReleasedWeights | None = None  # where released weights wait
        self._pinned: dict[str, torch.Tensor] = {}

    # -- weights ---------------------------------------------------------------------------

    def load_weights(self, named: Sequence[tuple[str, torch.Tensor]], version: int | None) -> None:
        """Copy named tensors in place; names and shapes are checked before anything is
        copied, so a bad update leaves the model as it was."""
        with self._lock, torch.no_grad():
            self._require_weights()
            current = self.model.state_dict()
            unknown = [n for n, _ in named if n not in current]
            reshaped = [n for n, t in named if n in current and t.shape != current[n].shape]
            if unknown or reshaped:
                raise ValueError(
                    f"tensors do not match the model: unknown {unknown[:5]}, "
                    f"wrong shape {reshaped[:5]}"
                )
            for name, tensor in named:
                if name in self._fp8:
                    self._fp8[name].load(tensor)
                else:
                    current[name].copy_(tensor)
            if version is not None:
                self._version = version

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """A full state dict (every key of the model's); partial updates use load_weights."""
        missing = self.model.state_dict().keys() - state_dict.keys()
        if missing:
            raise ValueError(f"state dict does not match the model: missing {sorted(missing)[:5]}")
        self.load_weights(list(state_dict.items()), version)

    def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None:
        loaded = AutoModelForCausalLM.from_pretrained(model_path, dtype=self._load_dtype)
        self.update_weights(loaded.state_dict(), self._version if version is None else version)
        self.model_path = model_path

    def export_weights(self) -> dict[str, torch.Tensor]:
        """A copy of the weights on the CPU, for an engine that replaces a lost one: it
        starts from the weights the others hold, not the trainer's newer ones."""
        with self._lock, torch.no_grad():
            self._require_weights()
            state = self.model.state_dict()
            # fp8: the weights it computes with (quantizing them again gives the same values)
            state.update({n: layer.dequantized() for n, layer in self._fp8.items()})
            return {n: t.detach().to("cpu", copy=True) for n, t in state.items()}

    def set_weight_version(self, version: int) -> None:
        self._version = version

    def weights_checksum(self) -> str:
        with self._lock:
            self._require_weights()
            return weights_checksum(self.model.state_dict().items())

    def release_memory(self, tags: Collection[str]) -> None:
        """Free the weights; the KV cache lives in batches, which the caller empties (pause)
        before releasing. On a GPU they wait in pinned host buffers kept from one release to
        the next (a colocated step releases and resumes every step: a round trip through a
        file cost ~1 s for 1.2 GB, bench/RESULTS.md); on a CPU in a local file."""
        with self._lock:
            if "weights" not in tags or self._released is not None:
                return
            params = dict(self.model.named_parameters())
            if self.device.type == "cuda":
                for name, p in params.items():
                    held = self._pinned.get(name)
                    if held is None or held.shape != p.shape or held.dtype != p.dtype:
                        self._pinned[name] = held = torch.empty(
                            p.shape, dtype=p.dtype, device="cpu", pin_memory=True)
                    held.copy_(p.data, non_blocking=True)
                torch.cuda.synchronize()
                self._released = ReleasedWeights(file=None)
            else:
                fd, path = tempfile.mkstemp(prefix="rollflow-weights-", suffix=".pt")
                os.close(fd)
                torch.save({n: p.data for n, p in params.items()}, path)
                self._released = ReleasedWeights(file=path)
            for p in params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._make_decoder()  # drops copies it made (fused weights, a captured graph)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # a colocated trainer needs the memory back

    def resume_memory(self, tags: Collection[str]) -> None:
        with self._lock:
            released = self._released
            if "weights" not in tags or released is None:
                return
            if released.file is None:
                for name, p in self.model.named_parameters():
                    p.data = self._pinned[name].to(self.device, non_blocking=True)
                torch.cuda.synchronize()
            else:
                saved = torch.load(released.file, map_location=self.device, weights_only=True)
                for name, p in self.model.named_parameters():
                    p.data = saved[name].to(p.device)
                os.remove(released.file)
            self._released = None

    def _make_decoder(self) -> None:
        """The decode step for this model and device: on a GPU, turns of it replayed as a
        CUDA graph (`cuda_graph_decode`) where the model has a Llama layout."""
        self._decoder = make_decoder(self.model, self.batch_invariant)
        self._graphs: CudaGraphTurns | None = None
        if self.cuda_graph and self.device.type == "cuda" and isinstance(self._decoder, LlamaDecoder):
            self._graphs = CudaGraphTurns(self._decoder, compile=self.torch_compile)

    def _require_weights(self) -> None:
        if self._released is not None:
            raise RuntimeError("weights are released: resume_memory_occupation first")

    # -- generation ------------------------------------------------------------------------

    def new_batch(self) -> DecodeBatch:
        return DecodeBatch(self.vocab_size)

    def generate(
        self, requests: list[GenRequest], should_abort: ShouldAbort = never_abort
    ) -> list[GenResult]:
        return run_to_completion(self, requests, should_abort)

    def step(self, batch: DecodeBatch, admit: Sequence[GenRequest]) -> list[GenResult]:
        with self._lock, torch.inference_mode():
            self._require_weights()
            batch.waiting.extend(self._state(r) for r in admit)
            self._note_version(batch)
            ended = self._decode(batch) if batch.num_running else []
            room = self.max_batch_size - batch.num_running
            if room > 0 and batch.waiting:
                new = [batch.waiting.popleft() for _ in range(min(room, len(batch.waiting)))]
                for s in new:
                    if len(s.out_ids) >= s.budget:
                        s.reason = {"type": "length", "length": len(s.out_ids)}
                        ended.append(s)
                live = [s for s in new if s.reason is None]
                if live:
                    ended += self._prefill(batch, live)
            batch.maybe_compact()
            return [self._result(s) for s in ended]

    def _note_version(self, batch: DecodeBatch) -> None:
        """After a weight update between two steps, the requests' next tokens come from the
        new version (every request: running, waiting and retracted alike)."""
        if batch.weight_version == self._version:
            return
        for s in [*batch.waiting, *(batch.rows[j] for j in batch.live_rows())]:
            s.note_version(self._version)
        batch.weight_version = self._version

    def abort(self, batch: DecodeBatch, rids: Collection[str] | None) -> list[GenResult]:
        with self._lock, torch.inference_mode():
            hit = (lambda rid: True) if rids is None else set(rids).__contains__
            ended = [s for s in batch.waiting if hit(s.request.rid)]
            if ended:
                batch.waiting = deque(s for s in batch.waiting if not hit(s.request.rid))
            live = batch.live_rows()
            ended += batch.end_rows([j for j in live if hit(batch.rows[j].request.rid)])
            for s in ended:
                s.reason = dict(_ABORT)
            batch.maybe_compact()
            return [self._result(s) for s in ended]

    def retract(self, batch: DecodeBatch) -> None:
        with self._lock, torch.inference_mode():
            running = [batch.rows[j] for j in batch.live_rows()]
            batch.waiting.extendleft(reversed(running))
            batch.drop_rows()

    def _state(self, r: GenRequest) -> ReqState:
        p = r.params
        seed = p.sampling_seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return ReqState(
            request=r,
            seed=seed,
            budget=max(0, min(p.max_new_tokens, self.context_len - len(r.input_ids))),
            stop_ids=list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids),
            version_spans=[(0, self._version)],
        )

    def _invariant_decoder(self) -> LlamaDecoder | None:
        """The decoder, where it computes each row on its own (batch-invariant mode)."""
        d = self._decoder
        return d if isinstance(d, LlamaDecoder) and d.batch_invariant else None

    def _prefill(self, batch: DecodeBatch, states: list[ReqState]) -> list[ReqState]:
        """One forward over the distinct prefixes (a GRPO group's samples share their
        prompt: the bench's batch of 64 holds 8 prompts), its logits and KV cache then
        repeated per request; a row's numbers do not depend on the other rows."""
        first: dict[tuple[int, ...], int] = {}
        index = [first.setdefault(tuple(s.prefix), len(first)) for s in states]
        rows = None if len(first) == len(states) else torch.tensor(index, device=self.device)
        prompts = [torch.tensor(p) for p in first]
        ids = torch.nn.utils.rnn.pad_sequence(
            prompts, batch_first=True, padding_value=self._pad_id, padding_side="left"
        ).to(self.device)
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        width = ids.shape[1]
        attn = (torch.arange(width, device=self.device)[None, :] >= width - lens[:, None]).long()
        positions = (attn.cumsum(-1) - 1).clamp_(min=0)
        self._use_threads(ids.numel())
        invariant = self._invariant_decoder()
        if invariant is not None:
            cache, last = invariant.prefill(ids, attn, room=1)
            fresh = DecodeBatch.prefilled(states, attn, cache, self.vocab_size, rows)
            ended = self._sample(fresh, last if rows is None else last[rows])
            batch.merge(fresh)
            return ended
        if self.device.type == "cuda" and isinstance(self._decoder, LlamaDecoder):
            # the head as one [rows, hidden] matmul: HF's `logits_to_keep` slice reached it as
            # a strided [rows, 1, hidden], which torch ran as a batched product reading the
            # whole head once a row (16 ms of a 0.55 s batch of 256 x 256 on the 0.5B shape)
            out = self.model.model(input_ids=ids, attention_mask=attn, position_ids=positions,
                                   use_cache=True)
            logits = self.model.lm_head(out.last_hidden_state[:, -1])
        else:
            out = self.model(
                input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True,
                logits_to_keep=1,
            )  # fmt: skip
            logits = out.logits[:, -1, :]
        fresh = DecodeBatch.prefilled(states, attn, out.past_key_values, self.vocab_size, rows)
        if self._routing is not None:
            routed = self._routing.take(*ids.shape)
            for s, row in zip(states, index, strict=True):
                s.routed = [routed[row, width - len(s.prefix):]]
        ended = self._sample(fresh, logits if rows is None else logits[rows])
        batch.merge(fresh)
        return ended

    def _decode(self, b: DecodeBatch) -> list[ReqState]:
        assert b.cache is not None
        self._use_threads(len(b.rows), getattr(self._decoder, "parallel_rows", None))
        if isinstance(self._decoder, LlamaDecoder) and (
                self.continuous_steps > 1 or self._graphs is not None):
            ended = self._decode_steps(b, self._decoder)
            if ended is not None:
                return ended
        logits = self._decoder(b.t["last_tok"], b.t["next_pos"], b.cache)
        b.t["next_pos"].add_(1)
        if self._routing is not None:  # the token each live row was fed
            routed = self._routing.take(len(b.rows), 1)
            for j in b.live_rows():
                b.rows[j].routed.append(routed[j])
        return self._sample(b, logits)

    def _decode_steps(self, b: DecodeBatch, decoder: LlamaDecoder) -> list[ReqState] | None:
        """Up to `continuous_steps` tokens in one compiled call or, on a GPU, as CUDA graph
        replays (SGLang's `num_continuous_decode_steps`; a graph runs rows with stop
        strings too, a step a turn); None where one step at a time must run: top-p/top-k,
        a row with stop strings on a CPU, or a model the compiled step does not cover."""
        assert b.cache is not None and b.sampling is not None
        finish = b.finish_rules()
        if finish is None and self._graphs is None:
            return None
        # (more steps than a row has left would only make the cache reserve columns, and
        # grow, copying every row, for tokens that row's finish cuts off)
        steps = 1 if finish is None else min(self.continuous_steps, finish.fewest_left)
        uniforms = b.uniforms(steps)
        if uniforms is not None:
            steps = uniforms.shape[0]  # (the table's end: the next turn draws a new one)
        args = (b.t["last_tok"], b.t["next_pos"], b.cache, steps, b.sampling, uniforms)
        if self._graphs is not None:
            out = self._graphs.decode_steps(*args, finish)
        else:
            assert finish is not None
            out = decoder.decode_steps(*args, finish)
        if out is None:
            return None
        b.t["next_pos"].add_(out[0].shape[0])
        return b.record(*out, self._match_stop)

    def _use_threads(self, tokens: int, parallel_rows: int | None = None) -> None:
        """One intra-op thread for a forward whose activations (tokens x hidden size) are
        under `_PARALLEL_ELEMENTS`, the configured count otherwise. A small step's ops are
        too short to split: each op's fork/join (a wake-up of sleeping OpenMP workers) costs
        more than it saves. On the example model small batches run faster on one thread and
        batch 64 faster on two (bench/RESULTS.md, "Embedded engine vs HF generate"). It
        applies to the calling thread only: the scheduler's. A decoder that splits its step
        itself (`parallel_rows`: the fewest rows worth two threads; the compiled step wakes
        the pool once a step, so smaller batches gain from two) sets its own threshold."""
        work = tokens * self._hidden
        parallel = work >= _PARALLEL_ELEMENTS if parallel_rows is None else tokens >= parallel_rows
        want = self._threads if parallel or self.device.type != "cpu" else 1
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def _sample(self, b: DecodeBatch, logits: torch.Tensor) -> list[ReqState]:
        assert b.sampling is not None
        logits, uniforms = logits.float(), b.uniforms(1)
        uniform = None if uniforms is None else uniforms[0]
        tok, logp = fused_decode.sample_tokens(self._fused, logits, b.sampling, uniform)
        return b.record(tok[None], logp[None], self._match_stop)

    def _match_stop(self, s: ReqState) -> str | None:
        """Check the stop strings against the tail of the text, as SGLang does."""
        window = max(map(len, s.request.params.stop)) + 1
        tail = self.tokenizer.decode(s.out_ids[-window:], skip_special_tokens=True)
        return next((stop for stop in s.request.params.stop if stop in tail), None)

    def _result(self, s: ReqState) -> GenResult:
        reason = s.reason or dict(_ABORT)
        routed = None
        if s.request.return_routed_experts and s.routed:
            routed = torch.cat(s.routed).numpy().reshape(-1)
        return GenResult(
            rid=s.request.rid,
            output_ids=s.out_ids,
            output_logprobs=s.out_logprobs,
            text=finish_text(self.tokenizer, s.out_ids, reason, s.request.params),
            finish_reason=reason,
            prompt_tokens=len(s.request.input_ids),
            weight_version=self._version,
            routed_experts=routed,
            version_spans=s.version_spans if len(s.version_spans) > 1 else None,
        )
