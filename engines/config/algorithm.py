"""The algorithm section: advantage estimator, loss and their coefficients."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from storage.config import Section

# Estimators whose advantage compares a sample with the other samples of its prompt (grpo and
# gspo normalise within the group, rloo leaves one out, the baseline subtracts the group
# mean): a group of one gets 0, so rollout.n_samples_per_prompt must be at least 2.
GROUP_ESTIMATORS = frozenset({"grpo", "gspo", "rloo", "reinforce_plus_plus_baseline"})


CorrectionMode = Literal[
    "none", "token_tis", "token_mis", "seq_tis", "seq_mis", "icepop", "decoupled"
]

# Bounds a mode uses when `low` / `high` are unset: TIS truncates from above only, as in
# Yao et al.'s TIS; MIS keeps a band around 1; the sequence ratio is a geometric mean, so
# its band is narrow; IcePop's [0.5, 5] is Ring-1T's; the decoupled cap 5 is AReaL's usual
# behav_imp_weight_cap.
DEFAULT_CORRECTION_BOUNDS: dict[str, tuple[float, float]] = {
    "none": (0.0, float("inf")),
    "token_tis": (0.0, 2.0),
    "seq_tis": (0.0, 2.0),
    "token_mis": (0.5, 2.0),
    "seq_mis": (0.99, 1.01),
    "icepop": (0.5, 5.0),
    "decoupled": (0.0, 5.0),
}


class RolloutCorrectionConfig(Section):
    """The train-inference mismatch correction: the engine (behaviour policy) samples with
    other probabilities than the trainer's old policy (bf16 kernels, MoE routing, stale
    weights), so each token's loss is weighted or masked by r = pi_old / pi_rollout, the
    ratio of the trainer's old log-probs to the engine's (no gradient). Needs the engine's
    log-probs on every sample. The formulas are in `engines/algorithms/corrections.py`."""

    mode: CorrectionMode = Field(
        "none",
        description="none: the loss is unchanged (the mismatch metrics are still reported); "
        "token_tis: weight clamp(r, low, high); token_mis: drop tokens with r outside "
        "[low, high]; seq_tis / seq_mis: the same on the sequence's geometric-mean ratio, "
        "for the whole sequence; icepop: weight r inside [low, high], drop the token "
        "outside (IcePop, Ring-1T); decoupled: AReaL's decoupled PPO, weight r, drop tokens "
        "with r above high (no lower bound).",
    )
    low: float | None = Field(
        None, ge=0.0,
        description="Lower bound on the ratio; None: the mode's default (tis 0, token_mis "
        "0.5, seq_mis 0.99, icepop 0.5). Not used by decoupled.",
    )
    high: float | None = Field(
        None, gt=0.0,
        description="Upper bound on the ratio; None: the mode's default (tis 2, token_mis 2, "
        "seq_mis 1.01, icepop 5, decoupled 5).",
    )

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def bounds(self) -> tuple[float, float]:
        """`(low, high)`, unset ones from the mode's defaults."""
        low, high = DEFAULT_CORRECTION_BOUNDS[self.mode]
        return (low if self.low is None else self.low, high if self.high is None else self.high)

    @model_validator(mode="after")
    def _check_bounds(self) -> RolloutCorrectionConfig:
        key = "algorithm.rollout_correction"
        if not self.enabled and (self.low is not None or self.high is not None):
            raise ValueError(
                f"{key}.low / {key}.high are set but {key}.mode is none: set a mode, or "
                "unset the bounds"
            )
        if self.mode == "decoupled" and self.low is not None:
            raise ValueError(
                f"{key}.low: decoupled has no lower bound (AReaL drops only tokens whose "
                f"ratio exceeds {key}.high); unset it"
            )
        low, high = self.bounds
        if self.enabled and not low <= 1.0 <= high:
            raise ValueError(
                f"{key}.low ({low}) and {key}.high ({high}) must satisfy low <= 1 <= high: a "
                "token the engine and the trainer agree on (ratio 1) must keep weight 1"
            )
        return self


class AlgorithmConfig(Section):
    loss_type: Literal["policy_loss", "sft_loss", "custom_loss"] = Field(
        "policy_loss", description="custom_loss calls `custom_loss_function_path`."
    )
    advantage_estimator: Literal[
        "grpo", "gspo", "ppo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"
    ] = Field("grpo", description="Advantage estimator (ppo trains a critic).")
    grpo_std_normalization: bool = Field(True, description="False gives Dr.GRPO.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount (ppo, reinforce++).")
    lambd: float = Field(1.0, ge=0.0, le=1.0, description="GAE lambda (ppo).")
    kl_coef: float = Field(
        0.0, ge=0.0, description="Reward shaping: per-token -kl_coef * KL(policy || ref)."
    )
    normalize_advantages: bool = Field(
        False, description="Whiten advantages over all masked tokens of the rollout batch."
    )
    eps_clip: float = Field(0.2, ge=0.0)
    eps_clip_high: float | None = Field(None, description="Clip-higher (default: eps_clip).")
    eps_clip_c: float | None = Field(
        None, gt=1.0, description="Dual-clip bound for negative advantages (> 1; None: off)."
    )
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(0.0, ge=0.0)
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = Field(
        "low_var_kl", description="KL estimator of the KL loss and of kl_coef shaping."
    )
    entropy_coef: float = 0.0
    calculate_per_token_loss: bool = Field(
        False, description="False: slime's per-sample mean over response tokens."
    )
    use_rollout_logprobs: bool = Field(
        False, description="Use the engine's log-probs as the old policy (skip a forward)."
    )
    rollout_correction: RolloutCorrectionConfig = Field(
        default_factory=RolloutCorrectionConfig,
        description="How the loss corrects for the engine sampling tokens with other "
        "probabilities than the trainer (see RolloutCorrectionConfig).",
    )
    value_clip: float = Field(0.2, gt=0.0, description="PPO value-loss clip range.")
    use_opd: bool = Field(
        False, description="On-policy distillation: advantages -= opd_kl_coef * (student - teacher)."
    )
    opd_kl_coef: float = Field(1.0, ge=0.0, description="Weight of the distillation signal.")
    opd_teacher_path: str | None = Field(
        None, description="HF model directory of the distillation teacher (same vocabulary)."
    )
    routing_replay: bool = Field(
        False,
        description="MoE models: the engines return the experts each token was routed to "
        "(SGLang's return_routed_experts) and the trainer's old-log-prob and training "
        "forwards route every token to those experts, weighted by its own router (R3); "
        "both train backends, padded rows (not train.pack_sequences).",
    )
    custom_loss_function_path: str | None = Field(
        None,
        description="Import string `(algo_cfg, LossInputs, denominator) -> (loss, metrics)`.",
    )
    custom_advantage_function_path: str | None = Field(
        None,
        description="Import string `(algo_cfg, AdvantageInputs) -> (advantages, returns)`.",
    )

    @model_validator(mode="after")
    def _check_algorithm(self) -> AlgorithmConfig:
        if self.loss_type == "custom_loss" and not self.custom_loss_function_path:
            raise ValueError("algorithm.custom_loss_function_path is required by custom_loss")
        if self.use_opd and not self.opd_teacher_path:
            raise ValueError("algorithm.opd_teacher_path is required when use_opd is true")
        if self.rollout_correction.enabled and self.use_rollout_logprobs:
            raise ValueError(
                f"algorithm.rollout_correction.mode={self.rollout_correction.mode!r} compares "
                "the trainer's old log-probs with the engine's, which "
                "algorithm.use_rollout_logprobs replaces by the engine's own (every ratio "
                "1): set one of them off"
            )
        return self

    @property
    def uses_critic(self) -> bool:
        return self.advantage_estimator == "ppo"

    @property
    def uses_reference(self) -> bool:
        """A frozen reference is scored for the KL loss and for KL reward shaping."""
        return self.use_kl_loss or self.kl_coef != 0

    @property
    def needs_groups(self) -> bool:
        """Whether the policy learns only from differences within a prompt's group: a
        group-relative estimator, not replaced by a custom one, with no distillation signal
        (on-policy distillation's per-token term needs no group)."""
        return (self.loss_type == "policy_loss" and self.advantage_estimator in GROUP_ESTIMATORS
                and not self.custom_advantage_function_path and not self.use_opd)
