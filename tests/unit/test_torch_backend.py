"""Batching helpers and the torch / mock train backends on the session's tiny Llama."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.hooks.loader import HookError
from engines.train.batching import (
    build_padded_batch,
    log_probs_from_logits,
    split_micro_batches,
)
from engines.train.metrics import TrainBackend
from engines.train.mock_backend import MockTrainBackend, index_checksum
from engines.train.torch_backend import TorchTrainBackend
from flows.config.run import AlgorithmConfig, TrainConfig
from storage.sample import Sample
from tests.support.samples import make_backend, make_samples


# -- batching -------------------------------------------------------------------------------
def test_log_probs_from_logits_by_hand() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])
    target = torch.tensor([1])
    # softmax(0, ln 3) = (1/4, 3/4)
    assert log_probs_from_logits(logits, target, 1.0).item() == pytest.approx(math.log(0.75))
    assert log_probs_from_logits(logits, target, 0.0).item() == pytest.approx(math.log(0.75))
    # T = 2: logits (0, ln 3 / 2) -> p = sqrt 3 / (1 + sqrt 3)
    s3 = math.sqrt(3.0)
    assert log_probs_from_logits(logits, target, 2.0).item() == pytest.approx(
        math.log(s3 / (1 + s3))
    )


def test_padded_batch_aligns_response_tokens_with_their_logits() -> None:
    a = Sample(index=0, group_index=0, tokens=[5, 6, 7, 8, 9], response_length=2, loss_mask=[1, 0])
    b = Sample(index=1, group_index=0, tokens=[10, 11, 12], response_length=1, loss_mask=[1])
    batch = build_padded_batch([a, b], pad_token_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    # a: prompt 3 tokens, response token 0 (=8) is predicted at position 2, token 1 (=9) at 3
    assert batch.logit_index[0].tolist() == [2, 3]
    assert batch.targets[0].tolist() == [8, 9]
    assert batch.logit_index[1, 0].item() == 1 and batch.targets[1, 0].item() == 12
    assert batch.response_mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert batch.loss_mask.tolist() == [[1.0, 0.0], [1.0, 0.0]]


def test_split_micro_batches_respects_padded_budget() -> None:
    lengths = [10, 3, 7, 2]
    # longest first: 10 alone (2 * 10 > 14); 7 + 3 -> 2 * 7 = 14; adding 2 -> 3 * 7 = 21 > 14
    assert split_micro_batches(lengths, 14) == [[0], [2, 1], [3]]
    assert split_micro_batches([20, 1], 5) == [[0], [1]]  # oversize sample alone
    batches = split_micro_batches([5, 9, 2, 2, 8, 4, 7], 18)
    assert sorted(i for mb in batches for i in mb) == list(range(7))
    for mb in batches:
        assert len(mb) * max([5, 9, 2, 2, 8, 4, 7][i] for i in mb) <= 18


# -- torch backend ----------------------------------------------------------------------------
def test_compute_log_probs_matches_a_manual_forward(tiny_model_dir: str) -> None:
    backend = make_backend(tiny_model_dir, temperature=0.7, max_tokens_per_micro_batch=40)
    samples = make_samples(6)
    got = backend.compute_log_probs(samples)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for s, lps in zip(samples, got, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0]
        logp = torch.log_softmax(logits / 0.7, dim=-1)
        p = s.prompt_length
        want = [logp[p + t - 1, s.tokens[p + t]].item() for t in range(s.response_length)]
        assert len(lps) == s.response_length
        assert lps == pytest.approx(want, abs=1e-5)


def test_train_advances_version_and_is_idempotent(tiny_model_dir: str) -> None:
    backend = make_backend(tiny_model_dir)
    samples = make_samples(8)
    assert backend.version == 0
    metrics = backend.train(samples, rollout_id=0)
    assert backend.version == 1
    assert metrics["num_samples"] == 8 and metrics["num_optimizer_steps"] == 1
    assert metrics["weight_version"] == 1 and metrics["skipped"] == 0.0
    rewards = torch.tensor([s.reward for s in samples])
    assert metrics["reward_mean"] == pytest.approx(rewards.mean().item())
    assert metrics["adv_mean"] == pytest.approx(0.0, abs=1e-6)  # group-centred
    # on-policy first step: ratio is exactly 1
    assert metrics["clipfrac"] == 0.0 and metrics["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    before = backend.state_dict_for_engine()
    assert backend.train(samples, rollout_id=0) == {"skipped": 1.0}
    after = backend.state_dict_for_engine()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert backend.version == 1
    backend.train(samples, rollout_id=1)
    assert backend.version == 2


def test_sft_loss_decreases_on_a_fixed_batch(tiny_model_dir: str) -> None:
    backend = make_backend(tiny_model_dir, algo={"loss_type": "sft_loss"})
    samples = make_samples(8)
    for s in samples:
        s.reward = None  # SFT needs no reward
    losses = [backend.train(samples, rollout_id=k)["loss"] for k in range(6)]
    assert losses[-1] < losses[0] - 0.3, losses
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses


def test_micro_batching_gives_the_same_update(tiny_model_dir: str) -> None:
    samples = make_samples(12, group_size=4)
    algo = {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01}
    big = make_backend(tiny_model_dir, lr=1e-4, clip_grad=100.0, algo=algo)
    small = make_backend(
        tiny_model_dir, lr=1e-4, clip_grad=100.0, algo=algo, max_tokens_per_micro_batch=16
    )
    m_big = big.train(samples, 0)
    m_small = small.train(samples, 0)
    for key in ("loss", "pg_loss", "entropy", "grad_norm"):
        assert m_small[key] == pytest.approx(m_big[key], abs=1e-5), key
    params_big = dict(big.model.named_parameters())
    for name, p in small.model.named_parameters():
        g_small = small.actor.optimizer.state[p]["exp_avg"]  # (1 - beta1) * grad after one step
        g_big = big.actor.optimizer.state[params_big[name]]["exp_avg"]
        torch.testing.assert_close(g_small, g_big, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(p.detach(), params_big[name].detach(), atol=1e-5, rtol=0)


def test_checkpoint_resume_continues_exactly(tiny_model_dir: str, tmp_path: Path) -> None:
    ckpt = os.path.join(str(tmp_path), "ckpt")
    train_kw: dict[str, Any] = {"global_batch_size": 4, "num_epochs_per_rollout": 2}
    algo = {"entropy_coef": 0.01}
    first, second = make_samples(8, seed=1), make_samples(8, seed=2)
    uninterrupted = make_backend(tiny_model_dir, algo, **train_kw)
    uninterrupted.train(first, 0)
    uninterrupted.save_checkpoint(ckpt)
    expected = uninterrupted.train(second, 1)

    with open(os.path.join(ckpt, "meta.json")) as f:
        assert json.load(f)["version"] == 1
    for name in ("config.json", "optimizer.pt", "rng.pt", "tokenizer.json"):
        assert os.path.exists(os.path.join(ckpt, name)), name
    resumed = make_backend(tiny_model_dir, algo, **train_kw)
    resumed.load_checkpoint(ckpt)
    assert resumed.version == 1
    got = resumed.train(second, 1)
    assert got["num_optimizer_steps"] == 4
    for key in ("loss", "pg_loss", "grad_norm", "entropy"):
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key
    a, b = uninterrupted.state_dict_for_engine(), resumed.state_dict_for_engine()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    # starting from `train.load` restores the same state
    from_load = TorchTrainBackend(
        TrainConfig.model_validate(
            {"model_path": tiny_model_dir, "load": ckpt, "lr": 1e-3, "seed": 7, **train_kw}
        ),
        AlgorithmConfig.model_validate(algo),
        num_threads=1,
    )
    assert from_load.version == 1
    assert from_load.train(second, 1)["loss"] == pytest.approx(expected["loss"], abs=1e-6)


def test_use_rollout_logprobs_and_state_dict_for_engine(tiny_model_dir: str) -> None:
    backend = make_backend(tiny_model_dir, algo={"use_rollout_logprobs": True})
    samples = make_samples(8)
    for s, lps in zip(samples, backend.compute_log_probs(samples), strict=True):
        s.rollout_log_probs = [x + 0.5 for x in lps]  # engine scored the tokens 0.5 higher
    metrics = backend.train(samples, 0)
    # ppo_kl = old - new = +0.5 on every masked token (before the update)
    assert metrics["approx_kl"] == pytest.approx(0.5, abs=1e-4)
    state = backend.state_dict_for_engine()
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert set(state) == set(fresh.state_dict())
    fresh.load_state_dict(state)
    name = next(iter(state))
    state[name].add_(1.0)  # a copy: the policy is untouched
    assert not torch.equal(state[name], backend.model.state_dict()[name].cpu())


# -- mock backend ---------------------------------------------------------------------------
def test_mock_backend_records_trains_and_checkpoints(tmp_path: Path) -> None:
    mock = MockTrainBackend(fail_at_rollout=1)
    assert isinstance(mock, TrainBackend)
    samples = make_samples(4)
    m0 = mock.train(samples, 0)
    assert m0["num_samples"] == 4 and m0["weight_version"] == 1
    assert m0["reward_mean"] == pytest.approx(sum(s.scalar_reward() for s in samples) / 4)
    assert m0["index_checksum"] == index_checksum([s.index for s in samples])
    assert mock.train(samples, 0) == {"skipped": 1.0}
    with pytest.raises(RuntimeError, match="injected"):
        mock.train(samples[:2], 1)
    mock.train(samples[:2], 1)  # the retry succeeds
    assert mock.trained_indices() == [100, 101, 102, 103, 100, 101]
    assert mock.compute_log_probs(samples[:1]) == [[-1 / 3] * samples[0].response_length]
    mock.save_checkpoint(str(tmp_path))
    other = MockTrainBackend()
    other.load_checkpoint(str(tmp_path))
    assert other.version == 2 and other.trained_by_rollout() == mock.trained_by_rollout()
    assert other.state_dict_for_engine() == {}  # no weights: only the version is pushed


# -- algorithms through the backend ---------------------------------------------------------
def _weights(backend: TorchTrainBackend) -> dict[str, torch.Tensor]:
    return backend.state_dict_for_engine()


def test_ppo_trains_critic_alone_first_then_actor(tiny_model_dir: str) -> None:
    algo = {"advantage_estimator": "ppo", "gamma": 1.0, "lambd": 0.95}
    backend = make_backend(
        tiny_model_dir, algo, num_critic_only_steps=1, num_steps_per_rollout=2
    )
    assert backend.critic_model is not None
    samples = make_samples(8)
    actor0 = _weights(backend)
    head0 = backend.critic_model.value_head.weight.detach().clone()
    m0 = backend.train(samples, 0)
    # critic-only rollout: the policy is untouched, the value head moved
    assert all(torch.equal(actor0[k], v) for k, v in _weights(backend).items())
    assert not torch.equal(head0, backend.critic_model.value_head.weight)
    assert m0["critic/value_loss"] > 0 and m0["num_optimizer_steps"] == 2
    assert "pg_loss" in m0 and m0["weight_version"] == 1
    losses = [backend.train(samples, k)["critic/value_loss"] for k in (1, 2, 3)]
    assert any(not torch.equal(actor0[k], v) for k, v in _weights(backend).items())
    assert losses[-1] < m0["critic/value_loss"], (m0["critic/value_loss"], losses)


def test_lr_warmup_is_applied_per_optimizer_step(tiny_model_dir: str) -> None:
    backend = make_backend(
        tiny_model_dir, lr_warmup_steps=4, num_steps_per_rollout=2
    )
    samples = make_samples(8)
    backend.train(samples, 0)  # steps 0, 1 ran at lr 1e-3 * (1/4, 2/4)
    assert backend.actor.optimizer.param_groups[0]["lr"] == pytest.approx(0.75e-3)
    m = backend.train(samples, 1)  # steps 2, 3 at 3/4 and 4/4 -> mean 0.875e-3
    assert m["lr"] == pytest.approx(0.875e-3)


def test_tis_and_mismatch_metrics_through_backend(tiny_model_dir: str) -> None:
    tis = {"rollout_correction": {"mode": "token_tis", "high": 1.2}}
    backend = make_backend(tiny_model_dir, algo=tis)
    samples = make_samples(8)
    for s, lps in zip(samples, backend.compute_log_probs(samples), strict=True):
        s.rollout_log_probs = [x - 0.5 for x in lps]  # engine 0.5 lower: ratio e^0.5 = 1.65
    m = backend.train(samples, 0)
    assert m["mismatch/ratio_mean"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert m["mismatch/ratio_min"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert m["mismatch/ratio_max"] == pytest.approx(math.exp(0.5), rel=1e-4)
    assert m["mismatch/truncated_frac"] == pytest.approx(1.0)  # every ratio 1.65 > 1.2
    assert m["mismatch/masked_frac"] == 0.0
    # k3 = r - 1 - log r with r = e^0.5: 1.6487 - 1 - 0.5 = 0.1487
    assert m["mismatch/k3_kl"] == pytest.approx(math.exp(0.5) - 1.5, rel=1e-3)
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(0.5, abs=1e-4)
    assert m["rollout_logprob_abs_diff"] == pytest.approx(0.5, abs=1e-4)
    bare = make_samples(2)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        make_backend(tiny_model_dir, algo=tis).train(bare, 0)


def test_distillation_from_itself_has_zero_reverse_kl(tiny_model_dir: str) -> None:
    algo = {"use_opd": True, "opd_teacher_path": tiny_model_dir, "kl_coef": 0.0}
    m = make_backend(tiny_model_dir, algo).train(make_samples(8), 0)
    assert m["opd_reverse_kl"] == pytest.approx(0.0, abs=1e-6)


def test_custom_loss_hook_drives_training(tiny_model_dir: str) -> None:
    algo = {
        "loss_type": "custom_loss",
        "custom_loss_function_path": "tests.unit.test_algorithms:_hook_loss",
    }
    backend = make_backend(tiny_model_dir, algo)
    samples = make_samples(8)
    losses = [backend.train(samples, k)["loss"] for k in range(3)]
    assert losses[-1] < losses[0]  # the hook is an NLL: it must go down


def _loss_as_float(algo: Any, inputs: Any, denominator: float) -> float:
    return float((inputs.log_probs * inputs.loss_mask).sum())


def test_a_custom_loss_of_the_wrong_type_is_a_hook_error(tiny_model_dir: str) -> None:
    algo = {"loss_type": "custom_loss",
            "custom_loss_function_path": "tests.unit.test_torch_backend:_loss_as_float"}
    with pytest.raises(HookError) as err:
        make_backend(tiny_model_dir, algo).train(make_samples(8), 0)
    message = str(err.value)
    assert message.startswith("algorithm.custom_loss_function_path: "
                              "tests.unit.test_torch_backend:_loss_as_float returned float ")
    assert "expected (a scalar loss tensor, {metric name: tensor})" in message


def test_offload_onload_keeps_state_and_training_identical(tiny_model_dir: str) -> None:
    a = make_backend(tiny_model_dir, {"advantage_estimator": "ppo"})
    b = make_backend(tiny_model_dir, {"advantage_estimator": "ppo"})
    samples = make_samples(8)
    a.train(samples, 0)
    b.train(samples, 0)
    b.offload()
    assert all(p.device.type == "cpu" for p in b.model.parameters())
    b.onload()
    ma, mb = a.train(samples, 1), b.train(samples, 1)
    assert mb["loss"] == pytest.approx(ma["loss"], abs=1e-7)
    assert mb["critic/value_loss"] == pytest.approx(ma["critic/value_loss"], abs=1e-7)
