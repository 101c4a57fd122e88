"""LoRA on the torch backend (`train.lora`): what trains, what a checkpoint holds, what the
engines get, and that a resumed run is the uninterrupted one."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prefect.states import Failed
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from engines.inference.engine_actor import EngineActor
from engines.train import lora
from engines.train.torch_backend import TorchTrainBackend
from engines.weights import hf_export
from engines.weights.sender import (
    DiskWeightSender,
    TensorWeightSender,
    check_weight_update_equal,
)
from engines.weights.sync import weights_checksum
from flows.config.loader import apply_overrides, config_from_dict
from flows.config.run import AlgorithmConfig, ConfigError, EngineConfig, TrainConfig
from tasks.retries import retry_transient
from tests.support.samples import make_backend, make_samples

LORA = {"rank": 4, "alpha": 8}
KL = {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01}
TRAIN_KW: dict[str, Any] = {"num_steps_per_rollout": 2, "lr_warmup_steps": 1,
                            "lr_decay_style": "linear", "lr_decay_steps": 10}


def lora_backend(model_dir: str, **kw: Any) -> TorchTrainBackend:
    return make_backend(model_dir, KL, lora=kw.pop("lora", LORA), **{**TRAIN_KW, **kw})


def base_state(model_dir: str) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def trained(tiny_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A LoRA backend after two steps, its checkpoint after the first, and the metrics and
    weights of its second step (the uninterrupted run)."""
    ckpt = str(tmp_path_factory.mktemp("lora") / "ckpt")
    backend = lora_backend(tiny_model_dir)
    backend.train(make_samples(8, seed=1), 0)
    backend.save_checkpoint(ckpt)
    second = backend.train(make_samples(8, seed=2), 1)
    return {"backend": backend, "ckpt": ckpt, "second": second}


# -- config -----------------------------------------------------------------------------------
def config(tiny_model_dir: str, overrides: list[str]) -> Any:
    raw = {"data": {"prompt_data": "p.jsonl"}, "rollout": {"num_rollout": 2, "rollout_batch_size": 4,
                                                       "n_samples_per_prompt": 2},
           "engine": {"backend": "mock"}, "train": {"model_path": tiny_model_dir}}
    return config_from_dict(apply_overrides(raw, overrides))


def test_lora_is_off_by_default_and_checked(tiny_model_dir: str) -> None:
    assert not TrainConfig().lora.enabled
    assert config(tiny_model_dir, ["train.lora.rank=8"]).train.lora.enabled
    with pytest.raises(ConfigError, match=r"train\.lora: LoRA is implemented by train.backend=torch"):
        config(tiny_model_dir, ["train.backend=megatron", "train.lora.rank=8"])
    with pytest.raises(ConfigError, match=r"train\.lora\.dropout must be 0"):
        config(tiny_model_dir, ["train.lora.rank=8", "train.lora.dropout=0.1"])
    with pytest.raises(ConfigError, match="train.lora needs train.model_path"):
        config(tiny_model_dir, ["train.model_path=null", f"train.load={tiny_model_dir}",
                                "train.lora.rank=8"])
    config(tiny_model_dir, ["train.backend=megatron"])  # megatron without LoRA stays valid


# -- what trains ------------------------------------------------------------------------------
def test_only_adapters_train_and_the_reference_is_the_base(tiny_model_dir: str) -> None:
    backend = lora_backend(tiny_model_dir)
    assert backend.ref_model is None  # no second copy: the base with adapters off
    in_optimizer = {id(p) for g in backend.actor.optimizer.param_groups for p in g["params"]}
    names = {n for n, p in backend.model.named_parameters() if id(p) in in_optimizer}
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    layers = backend.model.config.num_hidden_layers
    assert len(names) == 2 * 7 * layers  # A and B on q k v o gate up down ("all-linear")

    samples = make_samples(8, seed=1)
    metrics = backend.train(samples, 0)
    assert metrics["grad_norm"] > 0
    second = backend.train(make_samples(8, seed=2), 1)
    assert second["kl_loss"] > 0  # the adapters moved the policy away from the reference

    base = base_state(tiny_model_dir)
    inner = backend.model.get_base_model().state_dict()
    for key, value in inner.items():  # frozen base weights are untouched, bit for bit
        if ".lora_" not in key:
            assert torch.equal(value, base[key.replace(".base_layer.", ".")]), key
    ref_scorer = backend._ref_scorer()
    assert ref_scorer is not None
    plain = make_backend(tiny_model_dir)  # full model, untrained: the initial policy
    for got, want in zip(ref_scorer(samples), plain.compute_log_probs(samples), strict=True):
        assert got.tolist() == pytest.approx(want, abs=1e-6)
    policy = backend.compute_log_probs(samples)
    assert any(abs(a - b) > 1e-6 for p, w in zip(policy, plain.compute_log_probs(samples),
                                                  strict=True) for a, b in zip(p, w, strict=True))


# -- merged weights ---------------------------------------------------------------------------
def test_merged_weights_are_base_plus_scaled_ba_under_base_names(
    trained: dict[str, Any], tiny_model_dir: str
) -> None:
    backend: TorchTrainBackend = trained["backend"]
    merged = backend.state_dict_for_engine()
    base = base_state(tiny_model_dir)
    assert list(merged) == list(base)  # same names, same order: no prefixes, no lora_A/B
    scale = LORA["alpha"] / LORA["rank"]
    params = dict(backend.model.named_parameters())
    adapted = 0
    for name, w0 in base.items():
        a_key = f"base_model.model.{name.removesuffix('.weight')}.lora_A.default.weight"
        if a_key in params:
            b = params[a_key.replace("lora_A", "lora_B")].detach()
            expected = w0 + scale * b @ params[a_key].detach()
            torch.testing.assert_close(merged[name], expected, rtol=0, atol=1e-6)
            assert not torch.equal(merged[name], w0)
            adapted += 1
        else:
            assert torch.equal(merged[name], w0), name
    assert adapted == 7 * backend.model.config.num_hidden_layers  # q k v o gate up down
    # ... and equal to what peft's own merge_and_unload gives
    unloaded = copy.deepcopy(backend.model).merge_and_unload().state_dict()
    assert unloaded.keys() == merged.keys()
    assert all(torch.allclose(unloaded[k], merged[k], atol=1e-6) for k in merged)


def test_checkpoint_holds_peft_adapter_and_a_plain_merged_model(trained: dict[str, Any]) -> None:
    from peft import PeftModel

    backend: TorchTrainBackend = trained["backend"]
    ckpt: str = trained["ckpt"]
    adapter = os.path.join(ckpt, lora.ADAPTER_DIR)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(adapter))
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt", "meta.json", "MANIFEST.json"):
        assert os.path.exists(os.path.join(ckpt, name)), name
    saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)

    # The top level is an ordinary HF model: merged weights, loadable without peft.
    exported = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert type(exported).__name__ == "LlamaForCausalLM"
    # The adapter loads onto the base with peft, and both give the same logits.
    base = AutoModelForCausalLM.from_pretrained(backend.train_cfg.model_path, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, adapter)
    ids = torch.randint(4, 70, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits,
                                   with_adapter(input_ids=ids).logits, rtol=0, atol=1e-5)
    # the export is the checkpoint step's merge (step 0), not the backend's current one
    after_first = hf_export.engine_state_dict(with_adapter)
    assert all(torch.equal(exported.state_dict()[k], after_first[k]) for k in after_first)


# -- resume -----------------------------------------------------------------------------------
def test_resume_from_the_adapter_checkpoint_is_exact(
    trained: dict[str, Any], tiny_model_dir: str
) -> None:
    expected, ckpt = trained["second"], trained["ckpt"]
    want = trained["backend"].state_dict_for_engine()
    resumed = lora_backend(tiny_model_dir)
    resumed.load_checkpoint(ckpt)
    assert resumed.version == 1
    got = resumed.train(make_samples(8, seed=2), 1)
    for key in expected:
        if key != "train_tokens_per_s":
            assert got[key] == expected[key] or math.isnan(got[key]) == math.isnan(expected[key]) is True, key
    have = resumed.state_dict_for_engine()
    assert all(torch.equal(have[k], want[k]) for k in want)

    from_load = TorchTrainBackend(  # train.load names the checkpoint, model_path the base
        TrainConfig.model_validate({"model_path": tiny_model_dir, "load": ckpt, "lr": 1e-3,
                                    "seed": 7, "lora": LORA, **TRAIN_KW}),
        AlgorithmConfig.model_validate(KL), num_threads=1,
    )
    assert from_load.version == 1
    assert from_load.train(make_samples(8, seed=2), 1)["loss"] == expected["loss"]


def test_resume_refuses_other_adapter_settings_or_a_full_checkpoint(
    trained: dict[str, Any], tiny_model_dir: str, tmp_path: Path
) -> None:
    other = lora_backend(tiny_model_dir, lora={"rank": 8, "alpha": 8})
    with pytest.raises(lora.LoraResumeError, match=r"train\.lora\.rank=8 differs from the checkpoint"
                       ) as raised:
        other.load_checkpoint(trained["ckpt"])
    assert not retry_transient(None, None, Failed(data=raised.value))  # reported at once
    with pytest.raises(lora.LoraResumeError, match=r"train\.lora\.alpha=16 differs from the checkpoint"):
        lora_backend(tiny_model_dir, lora={**LORA, "alpha": 16}).load_checkpoint(trained["ckpt"])
    # The checkpoint adapts every linear layer ('all-linear'); fewer targets are refused ...
    fewer = lora_backend(tiny_model_dir, lora={**LORA, "target_modules": ["q_proj", "v_proj"]})
    with pytest.raises(lora.LoraResumeError, match=r"train\.lora\.target_modules=\['q_proj', "
                       r"'v_proj'\] adapts other modules .* only in the checkpoint: .*k_proj"):
        fewer.load_checkpoint(trained["ckpt"])
    # ... while the same modules named one by one resume (peft saved 'all-linear' as names).
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    linear = {n.rpartition(".")[2] for n, m in base.named_modules()
              if isinstance(m, torch.nn.Linear) and m is not base.get_output_embeddings()}
    same = lora_backend(tiny_model_dir, lora={**LORA, "target_modules": sorted(linear)})
    same.load_checkpoint(trained["ckpt"])
    assert same.version == 1
    full = make_backend(tiny_model_dir)
    full.save_checkpoint(str(tmp_path / "full"))
    with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
        lora_backend(tiny_model_dir).load_checkpoint(str(tmp_path / "full"))
    with pytest.raises(lora.LoraResumeError, match="was trained with LoRA"):
        full.load_checkpoint(trained["ckpt"])
    # ... but a LoRA checkpoint is a plain model to start a new run from
    assert make_backend(trained["ckpt"]).version == 0


# -- weight sync ------------------------------------------------------------------------------
@pytest.fixture()
def engine(tiny_model_dir: str) -> Iterator[EngineActor]:
    threads = torch.get_num_threads()
    actor = EngineActor(EngineConfig(backend="embedded", model_path=tiny_model_dir), 0,
                        num_threads=1)
    yield actor
    actor.shutdown()
    torch.set_num_threads(threads)


def test_engines_receive_merged_weights_under_base_names(
    trained: dict[str, Any], engine: EngineActor, tmp_path: Path
) -> None:
    backend: TorchTrainBackend = trained["backend"]
    merged_model = copy.deepcopy(backend.model).merge_and_unload()
    expected = weights_checksum(merged_model.state_dict().items())
    assert engine.weights_checksum() != expected

    sender = TensorWeightSender([engine.url()], bucket_bytes=64 * 1024)
    assert sender.update(backend.model, version=2) == [2]  # the engine refuses unknown names
    sender.close()
    assert engine.weights_checksum() == expected
    assert check_weight_update_equal(backend.model, [engine.url()]) == expected

    engine.update_weights_from_tensor(base_state(backend.train_cfg.model_path), 0)
    disk = DiskWeightSender([engine.url()], save_dir=str(tmp_path))
    assert disk.update(backend.model, version=3) == [3]
    disk.close()
    assert engine.weights_checksum() == expected
    assert not (tmp_path / "v000003" / "adapter_config.json").exists()

    engine.update_weights_from_tensor(backend.state_dict_for_engine(), 4)  # the Ray path
    assert engine.weights_checksum() == expected


def test_example_lora_config_is_grpo_yaml_with_adapters(tiny_model_dir: str) -> None:
    from flows.config.loader import load_config
    from tests.support import REPO_ROOT

    model = [f"train.model_path={tiny_model_dir}"]
    full = load_config(REPO_ROOT / "examples/arithmetic/grpo.yaml", model).model_dump()
    with_lora = load_config(REPO_ROOT / "examples/arithmetic/grpo_lora.yaml", model)
    assert with_lora.train.lora.enabled and with_lora.train.lr > full["train"]["lr"]
    other = with_lora.model_dump()
    for dumped in (full, other):  # everything else is the full fine-tuning example's
        for section, key in (("train", "lora"), ("train", "lr"), ("train", "num_epochs_per_rollout"),
                             ("train", "lr_decay_style"), ("train", "lr_decay_steps"),
                             ("storage", "run_name")):
            dumped[section].pop(key)
    assert other == full
