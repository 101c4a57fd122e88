"""Context parallelism for the torch trainer (`train.context_parallel: N`): each sequence of a
micro-batch is split across the N ranks of a context group, so one rank holds 1/N of its
activations and a sequence longer than one GPU's memory allows can train.

    rank r of N holds, of every row padded to a multiple of 2N and cut into 2N chunks,
    chunks r and 2N-1-r ("zigzag"): under a causal mask an early chunk attends to few keys
    and a late one to many, so each rank gets the same attention work.

        chunks:   0    1    2    3        (N = 2)
        rank 0:   ####           ####
        rank 1:        ####  ####

Everything but attention is per token, so a rank runs the model on its own tokens, at their
own positions (rotary embeddings read `position_ids`). Attention gathers the keys and values
of the whole row from the group (one all-gather a layer; its backward sums the gradients
each rank's queries put on them) and runs each local chunk against the keys up to its end,
causal from the bottom right (`causal_lower_right`: flash or memory-efficient kernels on a
GPU, no [T, T] mask). This is the all-gather form of context parallelism (as in Llama 3's
training), simpler than a ring and cheap for grouped-query models, whose keys and values are
a fraction of the activations.

Log-probs: each rank computes those of the response tokens whose logits it holds, and the
group sums them into the full `[B, R]` response space (`sum_over_group`; its backward passes
each rank its own share unchanged). Every rank then computes the same loss from the same
log-probs, its backward reaches only its own tokens, and the group's gradients add up to the
unsplit sequence's: the data-parallel loss scaling (`distributed.py`) holds as it is, with
the context group's ranks counted as ranks of one data-parallel share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engines.train.batching import PaddedBatch, kept_positions
from engines.train.chunked_head import head_token_stats, maybe_passed_through
from engines.train.token_stats import token_stats

ATTENTION_NAME = "rollflow_context_parallel"
SPLIT_KEYWORD = "context_split"


# -- the layout (pure) ----------------------------------------------------------------------
def padded_length(length: int, size: int) -> int:
    """`length` rounded up to a multiple of 2 x `size` (the zigzag's chunk count)."""
    chunks = 2 * size
    return -(-length // chunks) * chunks


def zigzag_chunks(length: int, size: int, rank: int) -> tuple[tuple[int, int], ...]:
    """`(start, end)` of the two chunks rank `rank` of `size` holds of a row of `length`
    (a multiple of 2 x `size`), in row order."""
    chunk = length // (2 * size)
    first, second = rank, 2 * size - 1 - rank
    return (first * chunk, (first + 1) * chunk), (second * chunk, (second + 1) * chunk)


def local_positions(length: int, size: int, rank: int) -> Tensor:
    """The row positions rank `rank` holds, in its local order."""
    return torch.cat([torch.arange(a, b) for a, b in zigzag_chunks(length, size, rank)])


def global_order(length: int, size: int) -> Tensor:
    """Where each row position sits in the group's gathered tensor (rank 0's local tokens,
    then rank 1's, ...): `gathered[global_order]` is the row in order."""
    held = torch.cat([local_positions(length, size, r) for r in range(size)])
    order = torch.empty_like(held)
    order[held] = torch.arange(length)
    return order


# -- collectives with the gradients context parallelism needs ----------------------------------
class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 2 (`[B, H, T_local, D]` -> `[B, H, N x T_local, D]`, ranks in
    order); backward: the gradients all ranks put on the gathered tensor, summed, this
    rank's slice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group, ctx.rank, ctx.width = group, dist.get_rank(group), x.shape[2]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        lo = ctx.rank * ctx.width
        return grad[:, :, lo : lo + ctx.width].contiguous(), None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward; backward passes the gradient through unchanged: every rank
    computes the same loss from the sum, so its own share's gradient is its own."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


# -- the group ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ContextGroup:
    """This rank's context group: `size` consecutive ranks of the process group."""

    size: int
    rank: int
    group: dist.ProcessGroup

    @classmethod
    def build(cls, size: int) -> ContextGroup | None:
        """The group of `train.context_parallel` = `size` ranks this rank belongs to (None
        for 1). A collective: every rank of the process group calls it."""
        if size == 1:
            return None
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world % size:
            raise ValueError(
                f"train.context_parallel={size} needs a train group of a multiple of {size} "
                f"ranks (cluster.actor_num_nodes x cluster.actor_num_gpus_per_node); this one "
                f"has {world}"
            )
        rank = dist.get_rank()
        mine = None
        for first in range(0, world, size):  # every rank creates every group, in order
            group = dist.new_group(list(range(first, first + size)))
            if first <= rank < first + size:
                mine = group
        assert mine is not None
        return cls(size, rank % size, mine)

    def gather_sequence(self, x: Tensor, order: Tensor) -> Tensor:
        """`[B, H, T_local, D]` -> the whole row `[B, H, T, D]`, in position order."""
        return _GatherSequence.apply(x, self.group)[:, :, order]

    def sum_over_group(self, x: Tensor) -> Tensor:
        return _SumOverGroup.apply(x, self.group)


@dataclass(frozen=True, slots=True)
class _RowSplit:
    """The row layout of the forward under way, for `attention`."""

    group: ContextGroup
    chunks: tuple[tuple[int, int], ...]  # this rank's, in the padded row
    order: Tensor  # global_order, on the device


def attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
    attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The attention transformers runs under `ATTENTION_NAME` (`use_context_parallel`):
    `[B, H, T_local, D]` queries against the whole row's keys, each local chunk causal from
    the bottom right. The layout comes as the forward's `context_split` keyword, which
    transformers hands down to attention, and an activation-checkpointed layer's
    recomputation gets again. Without it (the model used otherwise), causal sdpa over the
    whole row, or with a mask transformers' own sdpa."""
    from torch.nn.attention.bias import causal_lower_right
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    split = kwargs.pop(SPLIT_KEYWORD, None)
    if split is None and attention_mask is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    # keys and values with every query head's copy: sdpa's grouped-query option would take
    # torch's math kernel here, with a [T, T] matrix a head (out of memory at 32k in fp32)
    groups = getattr(module, "num_key_value_groups", 1)
    # one dtype: under autocast the rotary embedding leaves queries and keys in float32
    query, key = query.to(value.dtype), key.to(value.dtype)
    if split is None:  # the whole row here (an unsplit forward of a context-parallel model)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(key, groups), repeat_kv(value, groups), is_causal=True,
            scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    keys = repeat_kv(split.group.gather_sequence(key, split.order), groups)
    values = repeat_kv(split.group.gather_sequence(value, split.order), groups)
    outs, at = [], 0
    for start, end in split.chunks:
        q = query[:, :, at : at + end - start]
        at += end - start
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q, keys[:, :, :end], values[:, :, :end],
            attn_mask=causal_lower_right(end - start, end), scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def use_context_parallel(model: torch.nn.Module) -> None:
    """Run `model`'s (a transformers causal LM's) attention through `attention`."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, attention)
    config: Any = model.config
    config._attn_implementation = ATTENTION_NAME


def response_outputs(
    model: torch.nn.Module, batch: PaddedBatch, temperature: float, group: ContextGroup,
    entropy_grad: bool = False, trim_logits: bool = False, chunked_head: bool = False,
) -> tuple[Tensor, Tensor]:
    """`torch_models.response_outputs` of a padded batch, its rows split across `group`:
    `(log_probs, entropy)` `[B, R]` float32, the same on every rank of the group.
    `trim_logits`: the model runs its LM head on the held response positions only
    (`batching.kept_positions`), not on every held token."""
    rows, width = batch.input_ids.shape
    device = batch.input_ids.device
    length = padded_length(width, group.size)
    held = local_positions(length, group.size, group.rank).to(device)
    ids = torch.nn.functional.pad(batch.input_ids, (0, length - width))[:, held]
    # where each row position sits among this rank's tokens (-1: another rank's)
    offset = torch.full((length,), -1, dtype=torch.long, device=device)
    offset[held] = torch.arange(held.numel(), device=device)
    slot = offset[batch.logit_index]
    b, j = torch.nonzero((slot >= 0) & batch.response_mask.bool(), as_tuple=True)
    kw: dict[str, Any] = {}
    index = slot
    if trim_logits:
        needed = torch.zeros((rows, held.numel()), dtype=torch.bool, device=device)
        needed[b, slot[b, j]] = True
        kw["logits_to_keep"], where = kept_positions(needed)
        index = where.gather(1, slot.clamp(min=0))
    split = _RowSplit(group, zigzag_chunks(length, group.size, group.rank),
                      global_order(length, group.size).to(device))
    kw[SPLIT_KEYWORD] = split
    with maybe_passed_through(model, chunked_head) as head:
        out = model(input_ids=ids, position_ids=held.expand(rows, -1), use_cache=False, **kw)
    logits = out.logits[b, index[b, j]].unsqueeze(0)  # [1, held slots, V] (or H: `head`)
    targets = batch.targets[b, j].unsqueeze(0)
    if head is not None:
        log_probs, entropy = head_token_stats(logits, head, targets, temperature, entropy_grad)
    else:
        log_probs, entropy = token_stats(logits, targets, temperature, entropy_grad=entropy_grad)
    zeros = torch.zeros(batch.targets.shape, dtype=torch.float32, device=device)
    full_lp = zeros.index_put((b, j), log_probs[0].float())
    full_ent = zeros.index_put((b, j), entropy[0].float())
    return group.sum_over_group(full_lp), group.sum_over_group(full_ent)
