"""The megatron backend against HF and the torch backend on identical weights (1 GPU)."""

from __future__ import annotations

import pytest
import torch

from flows.config.run import AlgorithmConfig, TrainConfig
from tests.support.gpu import grpo_samples

pytestmark = pytest.mark.gpu


_samples = grpo_samples


def _cfgs(
    path: str, dtype: str = "float32", gbs: int | None = 8, **algo: object
) -> tuple[TrainConfig, AlgorithmConfig]:
    train = TrainConfig(model_path=path, lr=1e-3, dtype=dtype, global_batch_size=gbs,
                        max_tokens_per_micro_batch=64, seed=7)
    return train, AlgorithmConfig(**algo)


def test_megatron_logits_match_hf(qwen2_tiny_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from engines.train.megatron import MegatronTrainBackend

    backend = MegatronTrainBackend(*_cfgs(qwen2_tiny_dir))
    hf = AutoModelForCausalLM.from_pretrained(qwen2_tiny_dir, dtype=torch.float32).cuda()
    ids = torch.randint(0, 256, (2, 17), device="cuda")
    pos = torch.arange(17, device="cuda").expand_as(ids)
    with torch.no_grad():
        ours = backend.model(input_ids=ids, position_ids=pos, attention_mask=None)
        ref = hf(input_ids=ids).logits
    assert (ours.float() - ref).abs().max().item() < 1e-4
    # HF -> megatron -> HF gives back the exact weights (QKV and gate/up fused and split).
    exported = backend.state_dict_for_engine()
    for name, value in hf.state_dict().items():
        assert torch.equal(exported[name], value.cpu()), name


def test_torch_and_megatron_losses_agree(qwen2_tiny_dir: str) -> None:
    from engines.train.megatron import MegatronTrainBackend
    from engines.train.torch_backend import TorchTrainBackend

    samples = _samples()
    for algo in ({}, {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01},
                 {"calculate_per_token_loss": True}):
        mg = MegatronTrainBackend(*_cfgs(qwen2_tiny_dir, **algo))
        tb = TorchTrainBackend(*_cfgs(qwen2_tiny_dir, **algo))
        lp_m, lp_t = mg.compute_log_probs(samples), tb.compute_log_probs(samples)
        for a, b in zip(lp_m, lp_t, strict=True):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)
        for step in range(2):  # step 1 runs on weights both backends updated once
            m, t = mg.train(samples, step), tb.train(samples, step)
            for key in ("loss", "pg_loss", "kl_loss", "entropy", "approx_kl", "clipfrac"):
                assert m[key] == pytest.approx(t[key], abs=2e-4), (algo, step, key, m[key], t[key])
            assert m["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-3), (algo, step)
        assert m["approx_kl"] == pytest.approx(t["approx_kl"], abs=1e-5)


def test_step0_ppo_kl_is_zero_in_bf16(qwen2_tiny_dir: str) -> None:
    from engines.train.megatron import MegatronTrainBackend

    # One optimizer step (the whole batch), many micro-batches: every token is on-policy.
    backend = MegatronTrainBackend(*_cfgs(qwen2_tiny_dir, dtype="bfloat16", gbs=None))
    metrics = backend.train(_samples(seed=3), 0)
    assert abs(metrics["approx_kl"]) < 1e-6
    assert metrics["clipfrac"] == 0.0
    assert metrics["weight_version"] == 1.0


RESUME_CASES = {  # name: (dtype, algorithm, train overrides)
    "fp32 grpo": ("float32", {}, {}),
    "bf16 grpo": ("bfloat16", {}, {}),
    "bf16 ppo+critic, kl loss, lr warmup": (
        "bfloat16", {"advantage_estimator": "ppo", "use_kl_loss": True, "kl_loss_coef": 0.1},
        {"lr_warmup_steps": 3}),
}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_checkpoint_round_trip(qwen2_tiny_dir: str, tmp_path: pytest.TempPathFactory,
                               case: str) -> None:
    """Save after step 0, resume in a fresh backend: the restored weights are bit-exact and
    step 1 trains as the uninterrupted run does (bf16: every parameter, norms included, is
    bf16, so the distributed optimizer's checkpoint layout holds; critic and LR schedule
    position come back too)."""
    from transformers import AutoModelForCausalLM

    from engines.train.megatron import MegatronTrainBackend
    from engines.train.megatron.checkpoint import adam_step

    dtype, algo, overrides = RESUME_CASES[case]
    train, algo_cfg = _cfgs(qwen2_tiny_dir, dtype, **algo)
    train = train.model_copy(update=overrides)
    samples = _samples(seed=5)
    a = MegatronTrainBackend(train, algo_cfg)
    assert {p.dtype for p in a.model.module.parameters()} == {getattr(torch, dtype)}
    a.train(samples, 0)
    a.save_checkpoint(str(tmp_path))
    saved = a.export_weights()
    saved_step = adam_step(a.optimizer)
    expected = a.train(samples, 1)  # the uninterrupted run's next step
    after = a.export_weights()
    b = MegatronTrainBackend(train, algo_cfg)
    b.load_checkpoint(str(tmp_path))
    assert b.version == 1 and b.actor.lr_steps == a.actor.lr_steps - 2
    assert adam_step(b.optimizer) == saved_step == 2.0  # two optimizer steps (gbs 8 of 16)
    restored = b.export_weights()
    assert all(torch.equal(restored[k], saved[k]) for k in saved), case
    resumed = b.train(samples, 1)
    worst = max(float((b.export_weights()[k].float() - v.float()).abs().max())
                for k, v in after.items())
    print(f"resume {case}: loss {resumed['loss']!r} vs {expected['loss']!r}, "
          f"weights after step 1 max |diff| {worst:.3e}")
    keys = ["loss", "pg_loss", "grad_norm", "approx_kl", "lr"]
    keys += ["critic/value_loss", "critic/grad_norm"] if "critic/value_loss" in expected else []
    tol = 1e-5 if dtype == "float32" else 1e-3  # bf16 kernels' reduction order may vary
    for key in keys:
        assert resumed[key] == pytest.approx(expected[key], rel=tol, abs=1e-7), key
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    for name, value in hf.items():
        assert torch.allclose(restored[name].float(), value.float()), name


def test_a_save_starts_no_process(qwen2_tiny_dir: str, tmp_path: pytest.TempPathFactory) -> None:
    """megatron's writer would start a spawn-context Manager process (a fresh interpreter)
    on a rank's first save; `checkpoint._write_results_in_process` keeps its results in
    this process, and the checkpoint still loads."""
    import multiprocessing

    from engines.train.megatron import MegatronTrainBackend

    train, algo_cfg = _cfgs(qwen2_tiny_dir)
    a = MegatronTrainBackend(train, algo_cfg)
    a.train(_samples(seed=5), 0)
    a.save_checkpoint(str(tmp_path))
    assert not [p.name for p in multiprocessing.active_children() if "Manager" in p.name]
    b = MegatronTrainBackend(train, algo_cfg)
    b.load_checkpoint(str(tmp_path))
    saved, restored = a.export_weights(), b.export_weights()
    assert all(torch.equal(restored[k], saved[k]) for k in saved)


def test_offload_onload_keeps_training_exact(qwen2_tiny_dir: str) -> None:
    """Colocated runs: offload frees the GPU memory of weights, grads and Adam state (and
    the frozen reference), onload brings back exactly what was there."""
    from engines.train.megatron import MegatronTrainBackend

    train, algo = _cfgs(qwen2_tiny_dir, "bfloat16", use_kl_loss=True, kl_loss_coef=0.1)
    samples = _samples(seed=6)
    a, b = MegatronTrainBackend(train, algo), MegatronTrainBackend(train, algo)
    a.train(samples, 0)
    b.train(samples, 0)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    a.offload()
    freed = held - torch.cuda.memory_allocated()
    a.onload()
    got, expected = a.train(samples, 1), b.train(samples, 1)
    wa, wb = a.export_weights(), b.export_weights()
    worst = max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wb)
    print(f"offload freed {freed / 2**20:.1f} MiB; after onload loss {got['loss']!r} vs "
          f"{expected['loss']!r}, weights max |diff| {worst:.3e}")
    for key in ("loss", "grad_norm", "kl_loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-3), key
    assert worst <= 2 * train.lr  # at most one Adam step's sign flip apart
    assert freed > 0.5 * _model_bytes(b)  # one model's weights + grads + Adam, and the ref


def _model_bytes(backend: object) -> int:
    model = backend.model.module  # type: ignore[attr-defined]
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_use_settings_switches_the_lr_schedule_of_the_next_steps(qwen2_tiny_dir: str) -> None:
    """A replay trains each step under the settings it was trained under (`use_settings`);
    megatron reads the LR schedule at each optimizer step, from them."""
    from engines.train.megatron import MegatronTrainBackend
    from engines.train.step_settings import StepSettings

    train, algo = _cfgs(qwen2_tiny_dir)
    backend = MegatronTrainBackend(train, algo)
    samples = _samples(seed=5)
    assert backend.train(samples, 0)["lr"] == pytest.approx(1e-3)
    decayed = train.model_copy(update={"lr": 4e-3, "lr_decay_style": "linear",
                                       "lr_decay_steps": 8})
    backend.use_settings(StepSettings(decayed, algo, 1.0, None))
    # optimizer steps 2 and 3 (gbs 8 of 16 samples) of an 8-step decay from 4e-3: their mean
    assert backend.train(samples, 1)["lr"] == pytest.approx(4e-3 * (1 - 2.5 / 8))
    backend.use_settings(StepSettings(train, algo, 1.0, None))
    assert backend.train(samples, 2)["lr"] == pytest.approx(1e-3)
