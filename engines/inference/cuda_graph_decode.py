"""Decode turns on a GPU as replays of one captured CUDA graph (SGLang's CUDA-graph decode).

Launched from Python, `LlamaDecoder`'s step is ~25 kernels a layer, each a few microseconds
of CPU to launch: for a 0.5B model at batch 256 the GPU waited on Python for most of a
~15 ms step (16.4k tok/s, bench/RESULTS.md "GPU end to end"). Here the whole step (embed,
layers, head, sampling, and feeding the sampled token to the next step) is captured once
per running batch and replayed once per token: one launch a token, and one host sync a
turn, when the turn's tokens are read.

A graph reads fixed addresses, so it belongs to one cache (its buffers), one set of rows
(their sampling parameters) and one gathering of the weights; it is captured again when
any of them changes: the batch is compacted or merged, the cache grows, or the weights are
updated (about once a rollout step). To keep the cache from growing mid-batch, a turn
reserves the columns the longest live request can still use (up to `_MAX_RESERVE`), as far
as the GPU's free memory allows (`CudaGraphTurns.free_bytes`); where it does not, the cache
grows again at a later turn and the graph is captured again over it. The column is a
device tensor inside the graph: the eager ops' attention reads every column of the cache (the
unwritten ones masked); `triton_decode`'s kernels (the default where Triton imports) read the
column from the device and attend over the written ones only, eight kernels a layer, with
sampling in two. A turn decodes all its steps, then finds the first step at which a live
row finished, keeps the tokens up to it and un-marks the columns after it: the tokens kept
are those one step at a time would give. Its speed against HF `generate`: bench/RESULTS.md,
"Embedded engine vs HF generate on a GPU".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engines.inference import sampling as sampling_math
from engines.inference import triton_decode
from engines.inference.kv_cache import KVCache, RowFinish
from engines.inference.kv_decode import LlamaDecoder
from engines.inference.sampling import SamplingRows

_MAX_RESERVE = 2048  # cache columns a turn reserves ahead at most (the longest live budget)
_ALIGN = 64  # capacity rounded up to this: rows of similar budgets share a graph
_KV_SHARE = 0.9  # of the memory free for it a growing cache may take (the rest: the step's
#                  activations and the graph's pool, the allocator's fragmentation)

FreeBytes = Callable[[torch.device], int | None]


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes new cache buffers on `device` can take: the GPU's free memory and what torch's
    allocator holds unused (it hands that back before an allocation fails). None off a GPU:
    no cap (the CPU runs the turn eagerly, in tests)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


@dataclass(eq=False)
class _CapturedStep:
    """One captured step and the tensors it reads and writes at fixed addresses."""

    cache_layers: list[torch.Tensor]
    mask: torch.Tensor
    sampling: SamplingRows  # the rows it serves now
    read_rows: SamplingRows  # the rows whose tensors the graph reads (the same values)
    owner: weakref.ref[KVCache]  # the cache whose buffers it reads
    weights_key: list[tuple[int, int]]
    rope: torch.Tensor  # the RoPE table the graph reads
    tokens: torch.Tensor  # [rows] fed at the next step (the graph writes its sample here)
    positions: torch.Tensor  # [rows]
    col: torch.Tensor  # [1] the cache column the next step writes
    uniform: torch.Tensor | None  # [rows] this step's sampling uniforms (None: all greedy)
    tok_out: torch.Tensor
    logp_out: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None  # None: not captured (eager turns)

    def can_adopt(self, cache: KVCache, rows: SamplingRows, decoder: LlamaDecoder,
                  greedy: bool, capacity: int) -> bool:
        """Whether `cache` (and `rows`), once grown to `capacity` columns, has the very
        shapes this graph was captured for, and the cache it served is gone: a new batch
        of the same size (each generate of a bench, a rollout's next batch of the same
        groups) then replays this graph over its own buffers instead of capturing another
        (a capture ran the step twice from Python: ~40 ms at 256 rows on the 0.5B shape)."""
        read = self.read_rows
        return (
            self.owner() is None
            and cache.mask is not self.mask
            and self.mask.shape == (cache.mask.shape[0], capacity)
            and cache.capacity <= capacity
            and len(self.cache_layers) == len(cache.layers)
            and all(a.shape[:3] == b.shape[:3] and a.shape[4:] == b.shape[4:]
                    and a.shape[3] == capacity and a.dtype == b.dtype
                    for a, b in zip(self.cache_layers, cache.layers, strict=True))
            and (self.uniform is None) == greedy
            and (read.divisor is None) == (rows.divisor is None)
            and (read.greedy is None) == (rows.greedy is None)
            and read.all_greedy == rows.all_greedy
            and self.weights_key == decoder.weights_key
            and self.rope is decoder.rope_table(capacity)
        )  # fmt: skip

    def adopt(self, cache: KVCache, rows: SamplingRows) -> None:
        """Move `cache` into this graph's buffers (its written columns; the rest zero, as a
        grown cache's are) and `rows`' sampling parameters into the ones the graph reads;
        `cache` then holds these buffers, and its own go."""
        width = cache.width
        for i, (dst, src) in enumerate(zip(self.cache_layers, cache.layers, strict=True)):
            dst[..., :width, :].copy_(src[..., :width, :])
            dst[..., width:, :].zero_()
            cache.layers[i] = dst
        self.mask[:, :width].copy_(cache.mask[:, :width])
        self.mask[:, width:] = False
        cache.mask = self.mask
        for mine, theirs in ((self.read_rows.divisor, rows.divisor),
                             (self.read_rows.greedy, rows.greedy)):
            if mine is not None and theirs is not None:
                mine.copy_(theirs)
        self.sampling = rows
        self.owner = weakref.ref(cache)

    def serves(self, cache: KVCache, rows: SamplingRows, decoder: LlamaDecoder,
               greedy: bool) -> bool:
        return (
            self.mask is cache.mask
            and len(self.cache_layers) == len(cache.layers)
            and all(a is b for a, b in zip(self.cache_layers, cache.layers, strict=True))
            and self.sampling is rows
            and (self.uniform is None) == greedy
            and self.weights_key == decoder.weights_key
            and self.rope is decoder.rope_table(cache.capacity)
        )


class CudaGraphTurns:
    """`LlamaDecoder.decode_steps` for a model on a GPU: a turn of steps as graph replays.
    `capture=False` runs the same step eagerly each time (the CPU tests of the turn logic,
    and a way to tell a graph's fault from the step's); `compile` runs its layers through
    torch.compile (`LlamaDecoder.compile_layers`).

    `free_bytes` reads the device memory free for a growing cache (`device_free_bytes`;
    a test passes its own figure) and caps the columns a turn reserves ahead (`_capacity`):
    for a 7B-class model (32 layers, 8 KV heads of 128 dims, bf16: 128 KiB a token) at 256
    rows, `_MAX_RESERVE` columns are 64 GiB of keys and values, more than an 80 GB GPU
    holds beside the weights.
    """

    def __init__(
        self, decoder: LlamaDecoder, capture: bool = True, compile: bool = False,
        free_bytes: FreeBytes = device_free_bytes,
    ) -> None:
        self.decoder = decoder
        self.capture = capture
        self.free_bytes = free_bytes
        if compile:
            decoder.compile_layers()
        self._step: _CapturedStep | None = None
        self.captures = 0  # graphs captured so far (a test and the bench read it)
        self.adoptions = 0  # batches that took over an earlier batch's graph (`adopt`)

    def decode_steps(
        self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, steps: int,
        rows: SamplingRows, uniforms: torch.Tensor | None, finish: RowFinish | None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Up to `steps` tokens per row (`[steps taken, rows]` tokens and log-probs), each
        sample fed to the next step; the turn keeps the steps up to the first at which a
        live row finishes (`finish`; None: rows with stop strings, checked by the caller
        after each token, so one step). None where the graph does not apply (top-p/top-k:
        a sort per token, left to the eager step)."""
        if rows.truncates:
            return None
        if finish is None:
            steps = 1
        ahead = max(steps, min(_MAX_RESERVE, finish.most_left if finish else steps))
        capacity = _capacity(cache, steps, ahead, self.free_bytes)
        kept = self._step
        if kept is not None and kept.can_adopt(cache, rows, self.decoder, uniforms is None,
                                               capacity):
            kept.adopt(cache, rows)
            self.adoptions += 1
        elif capacity > cache.capacity:
            self._step = None  # it holds the old buffers: let each go once it is copied
        cache.reserve(capacity - cache.width, spare=False)
        col0 = cache.width
        step = self._captured(cache, rows, uniforms is None)
        fresh = step is None
        if step is None:
            step = self._new_step(cache, rows, uniforms is None)
        step.tokens.copy_(tokens)
        step.positions.copy_(positions)
        step.col.fill_(col0)
        out_tok = tokens.new_empty(steps, tokens.shape[0])
        out_logp = torch.empty(steps, tokens.shape[0], device=tokens.device)
        for i in range(steps):
            if uniforms is not None:
                assert step.uniform is not None
                step.uniform.copy_(uniforms[i])
            if i == 0 and fresh:
                self._capture(step)  # runs this step once, then captures it
            elif step.graph is not None:
                step.graph.replay()
            else:
                self._body(step)
            out_tok[i].copy_(step.tok_out)
            out_logp[i].copy_(step.logp_out)
        taken = steps if finish is None else _steps_kept(out_tok, finish)
        if taken < steps:
            cache.mask[:, col0 + taken : col0 + steps] = False
        cache.width = col0 + taken
        return out_tok[:taken], out_logp[:taken]

    def _captured(self, cache: KVCache, rows: SamplingRows, greedy: bool) -> _CapturedStep | None:
        step = self._step
        if step is not None and step.serves(cache, rows, self.decoder, greedy):
            return step
        return None

    def _new_step(self, cache: KVCache, rows: SamplingRows, greedy: bool) -> _CapturedStep:
        self._step = None  # the old graph's memory goes before the new one is captured
        count, dev = cache.mask.shape[0], cache.mask.device
        return _CapturedStep(
            cache_layers=list(cache.layers), mask=cache.mask, sampling=rows, read_rows=rows,
            owner=weakref.ref(cache),
            weights_key=list(self.decoder.weights_key),
            rope=self.decoder.rope_table(cache.capacity),
            tokens=torch.zeros(count, dtype=torch.long, device=dev),
            positions=torch.zeros(count, dtype=torch.long, device=dev),
            col=torch.zeros(1, dtype=torch.long, device=dev),
            uniform=None if greedy else torch.zeros(count, device=dev),
            tok_out=torch.zeros(count, dtype=torch.long, device=dev),
            logp_out=torch.zeros(count, device=dev),
        )

    def _capture(self, step: _CapturedStep) -> None:
        """Run the step once on a side stream (the real first step of the turn, and the
        warm-up that graph capture needs: cuBLAS picks its kernels and workspaces outside a
        capture), then capture it; the capture itself computes nothing."""
        if not self.capture:
            self._body(step)
            self._step = step
            return
        stream = torch.cuda.Stream(step.mask.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._body(step)
        torch.cuda.current_stream().wait_stream(stream)
        # cuBLAS keeps a workspace per stream, made at the first matmul (the run above): a
        # graph captured over it reads memory it does not own, which another capture in
        # the process frees and `empty_cache` unmaps (torch.compile's CUDA graph trees clear
        # the workspaces: HF's static-cache generate beside a graph kept across batches,
        # `_CapturedStep.adopt`, replayed into an illegal address). Cleared here, the matmuls
        # make theirs inside the capture, in the graph's own memory pool, as the trees do.
        torch._C._cuda_clearCublasWorkspaces()
        step.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step.graph, stream=stream, capture_error_mode="thread_local"):
            self._body(step)
        self._step = step
        self.captures += 1

    def _body(self, step: _CapturedStep) -> None:
        """What the graph holds: one decode step at `step.col`, its sample written out and
        fed back, the position and column advanced."""
        cache = KVCache(step.cache_layers, step.mask, 0)
        logits = self.decoder.step_at(step.tokens, step.positions, step.col, cache)
        rows = step.read_rows
        if self.decoder.triton:  # one kernel a row, on the logits in the model dtype
            tok, logp = triton_decode.sample(logits, rows.divisor, step.uniform, rows.greedy)
        else:
            tok, logp = sampling_math.sample_tokens(logits.float(), rows, step.uniform)
        step.tok_out.copy_(tok)
        step.logp_out.copy_(logp)
        step.tokens.copy_(tok)
        step.positions.add_(1)
        step.col.add_(1)


def _capacity(cache: KVCache, steps: int, ahead: int, free_bytes: FreeBytes) -> int:
    """The cache's columns for a turn: `ahead` past its width, rounded up to `_ALIGN`,
    unless growing to that does not fit in `_KV_SHARE` of `free_bytes`; then as many as
    fit, but never fewer than the turn's own `steps`. Growing copies the cache a layer at a
    time, each old buffer freed once copied, so the old layers but the last count as free
    too. Memory is probed only where the cache must grow."""
    want = _aligned(cache.width + ahead)
    if want <= cache.capacity:
        return want
    free = free_bytes(cache.mask.device)
    if free is None:
        return want
    freed = cache.capacity - cache.capacity // len(cache.layers)
    fits = int(free * _KV_SHARE) // cache.column_bytes + freed
    return max(_aligned(cache.width + steps), min(want, fits // _ALIGN * _ALIGN))


def _aligned(columns: int) -> int:
    return -(-columns // _ALIGN) * _ALIGN


def _steps_kept(tokens: torch.Tensor, finish: RowFinish) -> int:
    """Steps up to and including the first at which a live row ends (a stop token or its
    budget); all of them if none does. One host sync."""
    steps = tokens.shape[0]
    taken = torch.arange(1, steps + 1, device=tokens.device)[:, None]
    ends = (tokens[:, :, None] == finish.stop_ids[None]).any(-1) | (finish.left[None] <= taken)
    ended = (ends & finish.live[None]).any(-1)
    first = torch.where(ended.any(), ended.int().argmax() + 1, steps)
    return int(first)
