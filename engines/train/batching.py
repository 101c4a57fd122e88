"""From a list of `Sample`s to padded tensors, and from logits to response log-probs.

Layout. Sequences are right-padded to `[batch, seq_len]`. Every per-token quantity the
algorithms use lives in *response space* `[batch, max_response_len]`: slot `t` is response
token `t` of that sample, which a causal LM predicts from the logits at absolute position
`prompt_len + t - 1`. `logit_index` holds that position for every slot, so one gather turns
full-sequence logits into response-aligned logits, and the result lines up one-to-one with
`Sample.loss_mask` and `Sample.rollout_log_probs`.

Right padding is safe without position-id tricks: with a causal mask, pad tokens at the end
never influence the real tokens before them.

Micro-batches are bounded by *padded* tokens (batch * longest sequence), the number that
actually drives activation memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from storage.sample import Sample


def log_probs_from_logits(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at `targets`; `[..., V]` x `[...]` -> `[...]`.

    The engine samples from the tempered distribution, so the trainer must score tokens
    under the same temperature for the importance ratio to be right. Temperature 0 (greedy)
    has no tempered distribution and is treated as 1.
    """
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def effective_temperature(temperature: float) -> float:
    """The temperature the log-probs are computed at (0 means greedy -> 1)."""
    return temperature if temperature > 0 else 1.0


@dataclass(frozen=True, slots=True)
class PaddedBatch:
    """Right-padded model inputs plus response-space indices and masks for `len(samples)`
    samples. Shapes: `[B, L]` for inputs, `[B, R]` for response space."""

    input_ids: Tensor
    attention_mask: Tensor
    logit_index: Tensor
    targets: Tensor
    response_mask: Tensor
    loss_mask: Tensor
    response_lengths: tuple[int, ...]
    # Shared-prompt batches (`prompt_sharing.py`) only: one input row per distinct prompt, a
    # `[rows, 1, L, L]` boolean attention mask, positions restarting at each response, and
    # `logit_row[b, t]`, the input row whose logits predict slot t of sample b (else row b).
    position_ids: Tensor | None = None
    logit_row: Tensor | None = None
    # Varlen-packed batches (`packing.py`) only: int32 `[units + 1]` start offsets of the
    # causal sequences laid end to end in the one input row.
    cu_seqlens: Tensor | None = None
    # Routing replay (`routing_replay.py`) only: int64 `[B, L, layers, topk]`, the experts
    # the engine routed each input token to.
    routed_experts: Tensor | None = None

    @classmethod
    def of_samples(
        cls, samples: Sequence[Sample], input_ids: Tensor, attention_mask: Tensor,
        logit_index: Tensor, *, position_ids: Tensor | None = None,
        logit_row: Tensor | None = None, cu_seqlens: Tensor | None = None,
    ) -> PaddedBatch:
        """`samples` over the given input rows (padded, shared-prompt or packed); response
        space (targets, masks, lengths) is the samples' own, the same in every layout."""
        targets, response_mask, loss_mask = _response_targets(samples)
        return cls(
            input_ids=input_ids, attention_mask=attention_mask, logit_index=logit_index,
            targets=targets, response_mask=response_mask, loss_mask=loss_mask,
            response_lengths=tuple(s.response_length for s in samples),
            position_ids=position_ids, logit_row=logit_row, cu_seqlens=cu_seqlens,
        )

    @property
    def num_tokens(self) -> int:
        """Real (not padding) input tokens: what the forward pass actually computes on."""
        mask = self.attention_mask
        if mask.dim() == 4:  # a real token attends to itself, padding does not
            return int(mask.diagonal(dim1=-2, dim2=-1).sum().item())
        return int(mask.sum().item())

    def to(self, device: torch.device, non_blocking: bool = False) -> PaddedBatch:
        """The same batch with every tensor on `device` (a no-op on its own device).
        `non_blocking` (CPU -> CUDA): through pinned memory, so the copy queues behind the
        GPU's work instead of waiting for it."""
        pin = non_blocking and device.type == "cuda"
        moved = {
            f: (getattr(self, f).pin_memory() if pin else getattr(self, f)).to(
                device, non_blocking=non_blocking
            )
            for f in (
                "input_ids",
                "attention_mask",
                "logit_index",
                "targets",
                "response_mask",
                "loss_mask",
                "position_ids",
                "logit_row",
                "cu_seqlens",
                "routed_experts",
            )
            if getattr(self, f) is not None
        }
        return replace(self, **moved)


def padded_rows(
    rows: Sequence[Sequence[int] | Sequence[float]], width: int, fill: float, dtype: torch.dtype
) -> Tensor:
    """Rows of different lengths as one `[len(rows), width]` tensor, right-padded with `fill`.

    One tensor from padded Python lists: filling a preallocated tensor row by row costs a
    small tensor and a copy per row, a visible share of the arithmetic example's train step
    (bench/RESULTS.md, "Train step")."""
    return torch.tensor([[*r, *[fill] * (width - len(r))] for r in rows], dtype=dtype)


def _response_targets(samples: Sequence[Sample]) -> tuple[Tensor, Tensor, Tensor]:
    """`[B, R]` targets, response mask and loss mask (zero past each response's end)."""
    resp = max(max(s.response_length for s in samples), 1)
    targets = padded_rows([s.response_tokens for s in samples], resp, 0, torch.long)
    response_mask = padded_rows(
        [[1.0] * s.response_length for s in samples], resp, 0.0, torch.float32
    )
    loss_mask = padded_rows([s.loss_mask for s in samples], resp, 0.0, torch.float32)
    return targets, response_mask, loss_mask


def build_padded_batch(samples: Sequence[Sample], pad_token_id: int = 0) -> PaddedBatch:
    """Pad `samples` to one batch; every sample needs a non-empty prompt (the first response
    token is predicted from the last prompt position)."""
    if not samples:
        raise ValueError("cannot build a batch from zero samples")
    for s in samples:
        if s.prompt_length < 1:
            raise ValueError(f"sample {s.index}: needs at least one prompt token")
        if len(s.loss_mask) != s.response_length:
            raise ValueError(
                f"sample {s.index}: loss_mask has {len(s.loss_mask)} != {s.response_length} entries"
            )
    seq_len = max(len(s.tokens) for s in samples)
    resp_len = max(max(s.response_length for s in samples), 1)
    return PaddedBatch.of_samples(
        samples,
        input_ids=padded_rows([s.tokens for s in samples], seq_len, pad_token_id, torch.long),
        attention_mask=padded_rows(
            [[1] * len(s.tokens) for s in samples], seq_len, 0, torch.long
        ),
        logit_index=padded_rows(
            [range(s.prompt_length - 1, s.prompt_length - 1 + s.response_length)
             for s in samples], resp_len, 0, torch.long,
        ),
    )


def slot_rows(logit_index: Tensor, logit_row: Tensor | None) -> Tensor:
    """The input row of each `[B, R]` response slot, `[B, R]`: `logit_row`, or where a batch
    has none, sample b's slots on row b."""
    if logit_row is None:
        logit_row = torch.arange(logit_index.shape[0], device=logit_index.device).unsqueeze(-1)
    return logit_row.expand_as(logit_index)


def gather_response_logits(
    logits: Tensor, logit_index: Tensor, logit_row: Tensor | None = None
) -> Tensor:
    """`[rows, L, V]` full-sequence logits -> `[B, R, V]` logits that predict each response
    slot; `logit_row` says which input row holds them (default: sample b is row b)."""
    return logits[slot_rows(logit_index, logit_row), logit_index]


def logit_positions(batch: PaddedBatch) -> tuple[Tensor, Tensor]:
    """The input positions whose logits the response slots need, per input row, and where
    each slot's logits sit among them: `(keep [rows, K], index [B, R])`, so that
    `logits[rows, keep]` (an LM head run on `keep` only) gathered at `[logit_row, index]`
    equals the full logits gathered at `[logit_row, logit_index]`. Prompt and padding
    positions are dropped: the vocab projection (and its `[rows, L, V]` output) is the
    largest single cost of a small model with a large vocabulary. Rows needing fewer than K
    positions repeat other positions (computed, never read).

    Padded rows (no `logit_row`): row b keeps its response positions in order, so `index`
    is slot t itself (the kept logits are response space already: `response_aligned`), and
    K is the batch's response width, known without reading the device."""
    rows, width = batch.input_ids.shape
    device = batch.logit_index.device
    if response_aligned(batch):
        steps = torch.arange(batch.logit_index.shape[1], device=device)
        keep = (batch.logit_index[:, :1] + steps).clamp(max=width - 1)
        return keep, steps.expand_as(batch.logit_index)
    row = slot_rows(batch.logit_index, batch.logit_row)
    valid = batch.response_mask.bool()
    needed = torch.zeros((rows, width), dtype=torch.bool, device=device)
    needed[row[valid], batch.logit_index[valid]] = True
    keep, where = kept_positions(needed)
    return keep, where[row, batch.logit_index]


def response_aligned(batch: PaddedBatch) -> bool:
    """Whether `logit_positions(batch)`'s kept logits are the response slots themselves
    (`[B, R, V]`, slot t at kept position t): padded rows, one per sample."""
    return batch.logit_row is None


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """`t` on `device`; CPU -> CUDA through pinned memory, so the copy queues behind the
    GPU's work instead of waiting for it (a pageable copy synchronizes the stream)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def kept_positions(needed: Tensor) -> tuple[Tensor, Tensor]:
    """`[rows, L]` flags of the positions whose logits are needed -> `(keep [rows, K],
    where [rows, L])`: the needed positions of each row first, in order (K the most any row
    needs; a shorter row repeats others), and where each position sits in `keep`."""
    rows, width = needed.shape
    k = max(int(needed.sum(dim=1).max()), 1)
    # needed positions first, in order (a stable sort of the "not needed" flags)
    keep = torch.sort((~needed).to(torch.uint8), dim=1, stable=True).indices[:, :k]
    where = torch.zeros((rows, width), dtype=torch.long, device=needed.device)
    where.scatter_(1, keep, torch.arange(k, device=needed.device).expand(rows, k))
    return keep, where


def pad_response_values(values: Sequence[Tensor], width: int, fill: float = 0.0) -> Tensor:
    """Stack per-sample 1-D response tensors (ragged) into `[B, width]` float32."""
    device = values[0].device if values else None  # where they are: no host round trip
    out = torch.full((len(values), width), fill, dtype=torch.float32, device=device)
    for i, v in enumerate(values):
        out[i, : v.numel()] = v.float()
    return out


def unpad_response_values(x: Tensor, response_lengths: Sequence[int]) -> list[list[float]]:
    """Inverse of `pad_response_values`: one Python list per sample, response tokens only."""
    rows = x.detach().cpu().tolist()
    return [row[:n] for row, n in zip(rows, response_lengths, strict=True)]


def split_micro_batches(
    lengths: Sequence[int], max_tokens: int, packed: bool = False,
    groups: Sequence[int] | None = None,
) -> list[list[int]]:
    """Pack sample indices into micro-batches whose size stays within `max_tokens`: the
    padded size (count * longest), or with `packed` (sequence packing, `packing.py`) the sum
    of lengths; a single sample longer than the budget gets its own micro-batch.

    Samples are taken longest first, so similar lengths share a batch and padding is small.
    With `groups` (each sample's group, for batches that compute a prompt once for its
    group: `prompt_sharing.py`) a group's samples stay adjacent, groups taken by their
    longest sample: split by length alone, a GRPO group lands in several micro-batches and
    its prompt is computed in each. The returned indices refer to positions in `lengths`.
    Any split gives the same gradients (the loss is a sum of micro-batch terms), so only
    speed depends on this.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    longest: dict[int, int] = {}
    first: dict[int, int] = {}
    for i, g in enumerate(groups or ()):
        longest[g] = max(longest.get(g, 0), lengths[i])
        first.setdefault(g, i)

    def key(i: int) -> tuple[int, ...]:
        if groups is None:
            return (-lengths[i], i)
        g = groups[i]
        return (-longest[g], first[g], -lengths[i], i)

    order = sorted(range(len(lengths)), key=key)
    batches: list[list[int]] = []
    current: list[int] = []
    widest = total = 0
    for i in order:
        size = total + lengths[i] if packed else (len(current) + 1) * max(widest, lengths[i])
        if current and size > max_tokens:
            batches.append(current)
            current = []
        if not current:
            widest = total = 0
        current.append(i)
        widest, total = max(widest, lengths[i]), total + lengths[i]
    if current:
        batches.append(current)
    return batches
