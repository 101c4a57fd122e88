"""What a train backend supplies to the shared train step (`step.py`), and the records they
exchange. Everything model-specific sits behind `StepModel`; everything algorithmic
(partitioning, advantages, losses, metrics) stays in `step.py`, so a backend that implements
this Protocol runs every estimator, loss, critic, rollout correction, OPD and KL option by
construction.

    step.py                                  backend (StepModel)
    ───────                                  ───────────────────
    prepare: score(role, samples) ─────────► no-grad forward of policy / ref / teacher
                                             (log-probs) or critic (values), every rank
    per optimizer step and part:
      optimizer_step(part, samples,
                     micro_batches, loss_fn) ► for each micro-batch: forward -> `Forward`,
                                               loss_fn(rows, Forward) -> backward;
                                               reduce over ranks, skip non-finite, clip,
                                               step, advance its LR schedule
    check_weights_finite() ────────────────► every trained tensor, on every rank
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from torch import Tensor

from engines.train.batching import PaddedBatch
from storage.sample import Sample

Role = Literal["policy", "ref", "teacher", "critic"]
"""A model the step scores with: the policy, the frozen reference and distillation teacher
(log-probs), or the critic (values)."""

Part = Literal["actor", "critic"]
"""A trained part: each has its own optimizer and LR schedule."""

PREFIX: dict[str, str] = {"actor": "", "critic": "critic/"}
"""Metric-key prefix of each part's optimizer-step metrics."""


@dataclass(frozen=True, slots=True)
class Forward:
    """One micro-batch's model outputs in response space `[B, R]`, float32, on the model's
    device: log-probs (at the rollout temperature) and entropy for the actor, values for the
    critic. `batch` is the padded batch they were computed from, on the same device.
    `aux_loss`: an MoE actor's load-balancing loss of this micro-batch, already times the
    model's `router_aux_loss_coef` (a scalar with a gradient; None for dense models)."""

    batch: PaddedBatch
    log_probs: Tensor | None = None
    entropy: Tensor | None = None
    values: Tensor | None = None
    aux_loss: Tensor | None = None


MicroBatchLoss = Callable[[list[int], Forward], tuple[Tensor, dict[str, Tensor]]]
"""`(rows, forward) -> (loss, detached metric terms)` of one micro-batch; `rows` index the
step's samples. The loss already carries the whole step's denominator."""


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Rows of one micro-batch. `counted=False` marks the stand-in a rank without samples
    in this step runs (its loss times 0, its terms dropped), so that it still joins the
    step's collectives (DDP's all-reduce, megatron's grad reduce) instead of hanging them."""

    rows: list[int]
    counted: bool = True


class StepModel(Protocol):
    """The model-specific half of a train backend (see the module docstring)."""

    version: int

    @property
    def dp_rank(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    @property
    def lazy_old_log_probs(self) -> bool:
        """True when the first optimizer step may take its old log-probs from its own
        forward: every rank must see all of its samples again later (one DP rank, one
        pipeline stage)."""
        ...

    @property
    def shares_prompts(self) -> bool:
        """True when the actor's batches compute a prompt once for all of its responses in
        a micro-batch (`prompt_sharing.py`): micro-batches then keep groups together."""
        ...

    def score(self, role: Role, samples: list[Sample]) -> list[Tensor]:
        """Per-sample 1-D float32 CPU tensors (response tokens), the same on every rank."""
        ...

    def optimizer_step(
        self, part: Part, samples: list[Sample], micro_batches: list[MicroBatch],
        loss_fn: MicroBatchLoss,
    ) -> dict[str, float]:
        """One optimizer step of `part` over this rank's micro-batches. Returns the loss
        terms summed over micro-batches and ranks, `grad_norm` (absent when skipped),
        `skipped_steps` and `lr`, keys prefixed by `PREFIX[part]`; non-finite handling as
        `finite.py` says, decided alike on every rank."""
        ...

    def check_weights_finite(self) -> None:
        """Raise `NonFiniteError` if any trained tensor holds NaN/inf (on any rank)."""
        ...
