"""The algorithm section: advantage estimator, loss and their coefficients."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from storage.config import Section

# Estimators whose advantage compares a sample with the other samples of its prompt (grpo and
# gspo normalise within the group, rloo leaves one out, the baseline subtracts the group
# mean): a group of one gets 0, so rollout.n_samples_per_prompt must be at least 2.
GROUP_ESTIMATORS = frozenset({"grpo", "gspo", "rloo", "reinforce_plus_plus_baseline"})


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
    use_tis: bool = Field(
        False, description="Truncated importance sampling: weight pg by old/rollout ratio."
    )
    tis_clip: float = Field(2.0, gt=0.0, description="Upper truncation of the TIS weight.")
    tis_clip_low: float = Field(0.0, ge=0.0, description="Lower truncation of the TIS weight.")
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
        if self.use_tis and self.tis_clip_low > self.tis_clip:
            raise ValueError("algorithm.tis_clip_low must be <= algorithm.tis_clip")
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
