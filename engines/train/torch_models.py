"""Model plumbing shared by the actor, reference, teacher and critic: mixed precision,
loading, and no-grad scoring in token-budgeted micro-batches (the device choice:
`engines.train.device`).

Precision: weights (and so optimizer state) stay float32; `dtype: bfloat16` runs forward and
backward under `torch.autocast`. This is the usual mixed-precision recipe (fp32 master
weights), so a long run does not lose small updates to bf16 rounding.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from engines.train import context_parallel
from engines.train.batching import (
    PaddedBatch,
    build_padded_batch,
    effective_temperature,
    gather_response_logits,
    logit_positions,
    response_aligned,
    split_micro_batches,
)
from engines.train.chunked_head import (
    head_on_positions,
    head_token_stats,
    maybe_passed_through,
    plain_head,
)
from engines.train.context_parallel import ContextGroup
from engines.train.flash_attention import attention_mask_for, varlen_kwargs
from engines.train.routing_replay import replayed_routing
from engines.train.token_stats import token_stats
from storage.sample import Sample


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[None]:
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def load_causal_lm(path: str, device: torch.device) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.nn.Module.to(model, device)  # in place; transformers' typed `to` wrapper confuses mypy
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, each an FSDP unit (`fsdp.py`) and a unit of activation
    checkpointing: the classes an HF model names in `_no_split_modules` (LlamaDecoderLayer,
    Qwen2DecoderLayer, ...), else any module whose class name ends in DecoderLayer (a
    critic wraps an HF backbone)."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules()
            if type(m).__name__ in names or type(m).__name__.endswith("DecoderLayer")]


def checkpoint_activations(model: torch.nn.Module) -> None:
    """`train.activation_checkpointing`: each decoder layer keeps only its input for the
    backward and runs its forward again there, so a long sequence's activations need one
    layer's memory, for about one more forward of compute. torch's composable checkpoint
    (hooks, not a wrapper: the parameter names stay the HF model's), which also holds in
    eval mode, where HF's own gradient checkpointing is off (the trainer runs without
    dropout, in eval mode)."""
    from torch.distributed._composable import checkpoint

    for layer in decoder_layers(model):
        checkpoint(layer)


def compile_layers(model: torch.nn.Module) -> None:
    """`train.compile_layers`: each decoder layer's forward through torch.compile (dynamic
    shapes: micro-batches differ in length). Only the forward is compiled, so the hooks of
    activation checkpointing and FSDP2 around a layer stay as they are; the layers share one
    compiled graph (their parameters are its inputs)."""
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)  # type: ignore[method-assign]


def response_log_probs(
    model: torch.nn.Module,
    batch: PaddedBatch,
    temperature: float,
    entropy_grad: bool = False,
    context: ContextGroup | None = None,
    chunked_head: bool = False,
    flash: bool = False,
) -> tuple[Tensor, Tensor]:
    """Response-space `(log_probs, entropy)`, both `[B, R]` float32, at `temperature`."""
    log_probs, entropy, _ = response_outputs(model, batch, temperature, entropy_grad,
                                             context=context, chunked_head=chunked_head,
                                             flash=flash)
    return log_probs, entropy


def response_outputs(
    model: torch.nn.Module,
    batch: PaddedBatch,
    temperature: float,
    entropy_grad: bool = False,
    router_aux_loss: bool = False,
    context: ContextGroup | None = None,
    chunked_head: bool = False,
    flash: bool = False,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Response-space `(log_probs, entropy)`, both `[B, R]` float32, at `temperature`, and
    with `router_aux_loss` an MoE model's load-balancing loss (HF's, unscaled; None for a
    dense model). A batch with `routed_experts` replays them (`routing_replay.py`).
    `context`: the rows are split across this context-parallel group
    (`context_parallel.py`; a padded batch of a dense model). `chunked_head`: the LM head
    runs a chunk of tokens at a time (`chunked_head.py`, `train.chunked_lm_head`). `flash`:
    padded rows without their padding mask and varlen-packed rows through flash varlen
    attention (`flash_attention.py`, `train.flash_attention`).

    Entropy only carries a gradient when it is part of the loss; otherwise it is a metric
    and is computed off the graph.
    """
    if context is not None:
        log_probs, entropy = context_parallel.response_outputs(
            model, batch, effective_temperature(temperature), context, entropy_grad,
            trim_logits=trims_logits(model), chunked_head=chunked_head)
        return log_probs, entropy, None
    kw: dict[str, Any] = {}
    index = batch.logit_index
    aligned = False
    # the LM head on the response-predicting positions only: in the head itself where it is
    # a plain Linear (any transformers), else through transformers' per-row logits_to_keep
    plain = plain_head(model)
    passed: contextlib.AbstractContextManager[torch.nn.Linear | None]
    passed = maybe_passed_through(model, chunked_head)
    if plain is not None or trims_logits(model):
        keep, index = logit_positions(batch)
        aligned = response_aligned(batch)  # no gather (a copy of [B, R, V] and its backward)
        if plain is not None:
            passed = head_on_positions(plain, keep, passthrough=chunked_head)
        else:
            kw["logits_to_keep"] = keep
    if router_aux_loss:
        kw["output_router_logits"] = True
    mask: Tensor | None = batch.attention_mask
    if flash:
        mask = attention_mask_for(batch, keep_padding_mask=router_aux_loss)
        kw.update(varlen_kwargs(batch))
    with replayed_routing(model, batch.routed_experts), passed as head:
        out = model(input_ids=batch.input_ids, attention_mask=mask,
                    position_ids=batch.position_ids, use_cache=False, **kw)
    # the response positions' logits in the head's own dtype: `token_stats` reads them in
    # chunks (one fused kernel on a GPU) and keeps no float32 copy of the vocabulary; with
    # `chunked_head` these are the final hidden states, projected a chunk at a time
    logits = out.logits if aligned else gather_response_logits(out.logits, index,
                                                                batch.logit_row)
    if chunked_head:
        assert head is not None
        log_probs, entropy = head_token_stats(logits, head, batch.targets,
                                              effective_temperature(temperature), entropy_grad)
    else:
        log_probs, entropy = token_stats(logits, batch.targets,
                                         effective_temperature(temperature),
                                         entropy_grad=entropy_grad)
    aux = getattr(out, "aux_loss", None) if router_aux_loss else None
    return log_probs, entropy, aux


@functools.cache
def _slices_per_row() -> bool:
    """Whether transformers' `logits_to_keep` takes per-row positions (`[rows, K]`)."""
    try:
        from transformers.modeling_utils import slice_logits_to_keep
    except ImportError:
        return False
    hidden = torch.arange(6.0).reshape(2, 3, 1)
    try:
        kept = slice_logits_to_keep(hidden, torch.tensor([[0], [2]]))
    except (IndexError, RuntimeError):
        return False
    return kept.flatten().tolist() == [0.0, 5.0]


def trims_logits(model: torch.nn.Module) -> bool:
    """True when `model` (a transformers causal LM, maybe in DDP / peft) can run its LM head
    on chosen positions per row (`batching.logit_positions`)."""
    inner: torch.nn.Module = getattr(model, "module", model)  # DDP
    get_base = getattr(inner, "get_base_model", None)  # peft
    base = get_base() if callable(get_base) else inner
    params = inspect.signature(type(base).forward).parameters
    return "logits_to_keep" in params and _slices_per_row()


BatchFn = Callable[[PaddedBatch], Tensor]


BuildBatch = Callable[[Sequence[Sample], int], PaddedBatch]


def scoring_batches(samples: list[Sample], max_tokens: int, packed: bool = False,
                    by_group: bool = False) -> list[list[int]]:
    """The micro-batches `score_samples` cuts `samples` into (indices into `samples`)."""
    lengths = [len(s.tokens) for s in samples]
    groups = [s.group_index for s in samples] if by_group else None
    return split_micro_batches(lengths, max_tokens, packed, groups)


@torch.no_grad()
def score_samples(
    samples: list[Sample],
    fn: BatchFn,
    max_tokens: int,
    pad_token_id: int,
    device: torch.device,
    build: BuildBatch = build_padded_batch,
    packed: bool = False,
    by_group: bool = False,
    forwards: int = 0,
) -> list[Tensor]:
    """Apply `fn` (a `[B, R]` response-space function) to micro-batches of `samples`
    (made by `build`; `packed`: the budget counts real tokens; `by_group`: a group's
    samples share micro-batches, for shared prompts); one 1-D float32 CPU tensor per
    sample, trimmed to its response length. `forwards`: run at least that many, the first
    micro-batch again for the missing ones (discarded): where a forward is a collective
    (FSDP2), every rank must run as many."""
    result: list[Tensor] = [torch.empty(0)] * len(samples)
    batches = scoring_batches(samples, max_tokens, packed, by_group)
    stand_ins = [batches[0]] * max(forwards - len(batches), 0) if batches else []
    for k, mb in enumerate([*batches, *stand_ins]):
        batch = build([samples[i] for i in mb], pad_token_id).to(device, non_blocking=True)
        values = fn(batch).float().cpu()
        if k >= len(batches):
            continue
        for row, i in enumerate(mb):
            result[i] = values[row, : samples[i].response_length].clone()
    return result


def iter_state_tensors(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> Iterator[Tensor]:
    """Parameters, buffers and optimizer-state tensors: what offload/onload must move."""
    yield from module.parameters()
    yield from module.buffers()
    if optimizer is not None:
        for state in optimizer.state.values():
            # Adam keeps `step` on the CPU unless capturable; leave it there.
            yield from (v for k, v in state.items() if isinstance(v, Tensor) and k != "step")


def move_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, device: torch.device
) -> None:
    """Move a model and its optimizer state to `device` in place (tensors keep identity, so
    the optimizer's param references stay valid)."""
    for t in iter_state_tensors(module, optimizer):
        t.data = t.data.to(device, non_blocking=True)
        if t.grad is not None:
            t.grad = None
