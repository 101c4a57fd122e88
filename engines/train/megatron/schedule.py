"""Megatron's forward(-backward) schedule over rollout samples, and its outputs turned into
the shared step's response-space `Forward` (log-probs / entropy, or critic values).

`run` feeds token-budgeted micro-batches through `get_forward_backward_func()` (PP-aware),
padded or (`packed`, train.pack_sequences) as one varlen row each (megatron's `thd`);
`on_output(mb, batch, slots, output)` runs on the last pipeline stage with the model's raw
output, projected at the batch's N real response slots only (`response_head`: `[1, N, V/tp]`
logits, or `[1, N, 1]` values for the critic), and returns `(loss, result)`;
the results come back in micro-batch order (empty on other stages). `score` splits the
samples over DP ranks, runs forward-only and gives every rank every sample's tensor.
Megatron is imported inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from engines.train.batching import PaddedBatch, build_padded_batch
from engines.train.megatron import parallel
from engines.train.megatron.model import replayed_routing
from engines.train.megatron.response_head import ResponseSlots, select_positions
from engines.train.packing import build_packed_batch
from engines.train.routing_replay import build_replay_batch
from engines.train.step_model import Forward, MicroBatch
from engines.train.token_stats import token_stats
from storage.sample import Sample

OnOutput = Callable[[MicroBatch, PaddedBatch, ResponseSlots, Tensor], tuple[Tensor, Any]]
Replay = tuple[int, int] | None  # routing replay: (MoE layers, experts per token), or off


def build_batch(
    samples: list[Sample], pad_token_id: int, packed: bool, replay: Replay = None
) -> PaddedBatch:
    """A micro-batch as the model takes it: right-padded rows, or (`packed`) one row of the
    samples end to end for varlen attention (`packing.py`); with `replay` (the model's MoE
    layers and experts per token) padded rows carrying the engine's routed experts."""
    if packed:
        return build_packed_batch(samples, pad_token_id, varlen=True)
    if replay is not None:
        return build_replay_batch(samples, pad_token_id, replay)
    return build_padded_batch(samples, pad_token_id)


def packed_seq_params(batch: PaddedBatch, device: torch.device) -> Any:
    """megatron's `thd` description of a varlen-packed CPU batch, its offsets on `device`
    (None for a padded batch)."""
    if batch.cu_seqlens is None:
        return None
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch.cu_seqlens
    longest = int((cu[1:] - cu[:-1]).max())  # on the CPU: no device sync
    cu = cu.to(device, non_blocking=True)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def _device_batches(
    samples: list[Sample], micro_batches: list[MicroBatch], pad_token_id: int, packed: bool,
    device: torch.device, replay: Replay = None,
) -> Iterator[tuple[MicroBatch, PaddedBatch, ResponseSlots, Any]]:
    """Each micro-batch (and its real response slots) built on the CPU when the schedule
    asks for it and copied without waiting (pinned memory): building the next one overlaps
    the GPU's work on the last."""
    for mb in micro_batches:
        batch = build_batch([samples[i] for i in mb.rows], pad_token_id, packed, replay)
        slots = ResponseSlots.of(batch).to(device, non_blocking=True)
        yield mb, batch.to(device, non_blocking=True), slots, packed_seq_params(batch, device)


def run(
    model: Any, samples: list[Sample], micro_batches: list[MicroBatch], pad_token_id: int,
    on_output: OnOutput, forward_only: bool, packed: bool = False, replay: Replay = None,
) -> list[Any]:
    """Megatron's schedule over `micro_batches` (rows of `samples`); see the module doc.
    `replay`: route every token to the experts the engine did (`model.replayed_routing`)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = parallel.current_device()

    def forward_step(data_iterator: Any, m: Any) -> tuple[Tensor, Any]:
        mb, batch, slots, seq_params = next(data_iterator)
        ids = batch.input_ids
        pos = batch.position_ids
        if pos is None:
            pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        select_positions(m, slots)
        with replayed_routing(m, batch.routed_experts):
            out = m(input_ids=ids, position_ids=pos, attention_mask=None,
                    packed_seq_params=seq_params)

        def loss_func(output: Tensor) -> tuple[Tensor, Tensor, Any]:
            loss, result = on_output(mb, batch, slots, output)
            return loss, torch.ones((), dtype=torch.int, device=output.device), result

        return out, loss_func

    # Shapes for pipeline sends only (variable_seq_lengths: the real ones travel with them).
    lengths = [[len(samples[i].tokens) for i in mb.rows] for mb in micro_batches]
    return list(get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=_device_batches(samples, micro_batches, pad_token_id, packed, device,
                                      replay),
        model=[model], num_microbatches=len(micro_batches),
        seq_length=max(sum(ls) if packed else max(ls) for ls in lengths),
        micro_batch_size=1 if packed else max(len(ls) for ls in lengths),
        forward_only=forward_only,
    ))


def even_micro_batches(micro_batches: list[MicroBatch]) -> list[MicroBatch]:
    """`micro_batches` plus uncounted stand-ins (sample 0) up to the most any DP rank runs,
    where expert parallelism needs every rank in each forward (`parallel.max_over_dp`)."""
    extra = parallel.max_over_dp(len(micro_batches)) - len(micro_batches)
    return micro_batches + [MicroBatch([0], counted=False) for _ in range(extra)]


def to_forward(
    batch: PaddedBatch, slots: ResponseSlots, output: Tensor, values: bool, temperature: float,
    entropy: bool = True, entropy_grad: bool = False,
) -> Forward:
    """The model's `[1, N, X]` output at the real response `slots` -> response-space
    `Forward`, 0 at padding slots (TP-aware: logits are vocab-sharded; `token_stats` gives
    log-probs and entropy of the N rows in one fused pass)."""
    flat = output.reshape(-1, output.shape[-1])
    if values:
        return Forward(batch, values=slots.scatter(flat.squeeze(-1).float()))
    group, start = parallel.tp_vocab_shard(flat.shape[-1])
    log_probs, ent = token_stats(flat, slots.gather(batch.targets), temperature, group, start,
                                 entropy_grad)
    return Forward(batch, log_probs=slots.scatter(log_probs),
                   entropy=slots.scatter(ent) if entropy else None)


@torch.no_grad()
def score(
    model: Any, samples: list[Sample], max_tokens: int, pad_token_id: int, values: bool,
    temperature: float, packed: bool = False, replay: Replay = None,
) -> list[Tensor]:
    """Per-sample response log-probs (or values) as CPU float32, on every rank. DP ranks
    split the samples (strided, as a training step does, so a step scored alone runs in the
    micro-batches that train on it); the last stage's results reach every stage."""
    from megatron.core import parallel_state as ps

    from engines.train.batching import split_micro_batches

    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = list(range(rank, len(samples), dp))
    local: dict[int, Tensor] = {}
    lengths = [len(samples[i].tokens) for i in mine]
    split = split_micro_batches(lengths, max_tokens, packed) if mine else []
    mbs = even_micro_batches([MicroBatch([mine[j] for j in mb]) for mb in split])
    if mbs:

        def on_output(
            mb: MicroBatch, batch: PaddedBatch, slots: ResponseSlots, output: Tensor
        ) -> tuple[Tensor, Any]:
            fwd = to_forward(batch, slots, output, values, temperature, entropy=False)
            t = fwd.values if values else fwd.log_probs
            assert t is not None
            per = [(i, t[r, : samples[i].response_length].float().cpu().clone())
                   for r, i in enumerate(mb.rows)] if mb.counted else []
            return t.sum() * 0.0, per

        for out in run(model, samples, mbs, pad_token_id, on_output, True, packed, replay):
            local.update(out)
    local = parallel.broadcast_from_last_stage(local)
    merged: dict[int, Tensor] = {}
    for part in parallel.all_gather_dp(local):
        merged.update(part)
    return [merged[i] for i in range(len(samples))]
