"""MoE routing replay (R3): the trainer's forwards route each token to the experts the
engine routed it to.

An MoE model's log-prob depends on a discrete choice, the top-k experts of each token in
each layer. The engine and the trainer compute the router's scores with different kernels,
batch shapes or precision, so a token whose scores are close picks other experts in the
trainer, and its log-prob moves far more than any rounding of a dense model would: the
importance ratio of a sample generated on-policy is no longer 1. Replay takes the *choice*
from the rollout (`Sample.routed_experts`, recorded by the engine) and keeps the *weights*
the trainer's own router gives those experts (softmax of its logits at the recorded ids,
renormalised as the model does), so the router still learns through them.

A replayed forward runs on plain padded rows (`build_replay_batch`: row b is sample b,
positions from 0), whose `[rows * length]` router inputs line up with the recorded ids.
Every token but the last is replayed, prompt included; the last token and the padding get
ids 0..k-1, which no kept logit depends on (causal attention, right padding).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from engines.train.batching import PaddedBatch, build_padded_batch
from engines.weights.model_families import moe_layout, moe_routers
from storage.sample import Sample


class RoutingReplayError(ValueError):
    """A sample without (or with the wrong number of) recorded routed experts."""


def build_replay_batch(
    samples: Sequence[Sample], pad_token_id: int, layout: tuple[int, int]
) -> PaddedBatch:
    """`build_padded_batch` plus `routed_experts`, int64 `[B, L, layers, topk]`, from each
    sample's recorded experts (`layout`: the model's layers and experts per token)."""
    batch = build_padded_batch(samples, pad_token_id)
    layers, topk = layout
    rows, width = batch.input_ids.shape
    routed = np.broadcast_to(np.arange(topk, dtype=np.int16), (rows, width, layers, topk)).copy()
    for b, s in enumerate(samples):
        if s.routed_experts is None:
            raise RoutingReplayError(
                f"{s.describe()}: algorithm.routing_replay needs the experts the engine routed "
                "each token to, and none were recorded (an MoE model on the embedded engine, or "
                "SGLang started with --enable-return-routed-experts)"
            )
        tokens = len(s.tokens) - 1
        try:
            routed[b, :tokens] = s.routed_experts.per_token(tokens, layers, topk, s.describe())
        except ValueError as e:
            raise RoutingReplayError(str(e)) from None
    return replace(batch, routed_experts=torch.from_numpy(routed).long())


@contextlib.contextmanager
def replayed_routing(model: torch.nn.Module, routed: Tensor | None) -> Iterator[None]:
    """While open, each MoE router of `model` returns the experts in `routed`
    (`[B, L, layers, topk]`, the forward's `[B, L]` tokens) with its own weights for them;
    `routed` None replays nothing."""
    if routed is None:
        yield
        return
    handles = []
    for layer, router in moe_routers(model):
        ids = routed[:, :, layer].reshape(-1, routed.shape[-1])
        handles.append(router.register_forward_hook(functools.partial(_replay, ids, layer)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _replay(ids: Tensor, layer: int, router: Any, args: Any, output: Any) -> tuple[Tensor, ...]:
    """A Qwen3-MoE router's `(logits, top-k weights, top-k ids)` with the recorded ids: the
    weights are the softmax at those ids (renormalised when `norm_topk_prob`), as the
    router computes them for its own choice."""
    logits = output[0]
    if logits.shape[0] != ids.shape[0]:
        raise RoutingReplayError(
            f"routing replay of layer {layer}: the router saw {logits.shape[0]} tokens, the "
            f"batch recorded {ids.shape[0]} (a replayed forward must run on plain padded rows)"
        )
    ids = ids.to(logits.device)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights = probs.gather(1, ids)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), ids


def replay_layout(model: torch.nn.Module) -> tuple[int, int]:
    """(layers, experts per token) of the MoE model `model` (DDP or peft wrapped or not); a
    clear error for a dense model, which has no routing to replay."""
    inner: Any = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    layout = moe_layout(config)
    if layout is None:
        raise RoutingReplayError(
            f"algorithm.routing_replay needs an MoE model; model_type "
            f"{getattr(config, 'model_type', None)!r} has no experts"
        )
    return layout
