"""YAML + --set overrides, and errors that name the key."""

from __future__ import annotations

import os

import pytest

from flows.config.loader import config_from_dict, load_config
from flows.config.run import ConfigError

BASE = """
data: {prompt_data: p.jsonl}
rollout: {num_rollout: 2, rollout_batch_size: 4, n_samples_per_prompt: 2}
engine: {backend: mock}
train: {backend: mock}
"""


def write(tmp_path, text=BASE):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_overrides_are_typed(tmp_path):
    cfg = load_config(write(tmp_path), ["rollout.n_samples_per_prompt=8", "train.lr=1e-4",
                                        'rollout.stop=["\\n", "."]', "logging.plot=false"])
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.rollout.stop == ["\n", "."]
    assert cfg.logging.plot is False


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.n_samples_per_promt"):
        load_config(write(tmp_path), ["rollout.n_samples_per_promt=8"])


def test_bad_value_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.rollout_batch_size"):
        load_config(write(tmp_path), ["rollout.rollout_batch_size=zero"])


def test_missing_required_section_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout"):
        load_config(write(tmp_path, "data: {prompt_data: p.jsonl}\n"))


def test_cross_section_requirements(tmp_path):
    with pytest.raises(ConfigError, match="model_path"):
        load_config(write(tmp_path), ["train.backend=torch"])


def test_storage_secrets_never_reach_config_yaml_but_survive_pickling():
    import pickle

    import yaml

    from flows.config.loader import dump_config
    from flows.config.run import REDACTED, StorageConfig, drop_redacted

    options = {"key": "AKIA123", "secret": "s3cr3t", "anon": False,
               "client_kwargs": {"region_name": "us-east-1", "aws_session_token": "tok"}}
    storage = StorageConfig(storage_options=options)
    dumped = storage.model_dump(mode="json")["storage_options"]
    assert dumped == {"key": REDACTED, "secret": REDACTED, "anon": False,
                      "client_kwargs": {"region_name": "us-east-1", "aws_session_token": REDACTED}}
    # Ray ships configs by pickle: the actors still get the real values.
    assert pickle.loads(pickle.dumps(storage)).storage_options == options
    # Read back (replay), the placeholders are dropped so env credentials apply.
    assert drop_redacted(dumped) == {"anon": False, "client_kwargs": {"region_name": "us-east-1"}}
    cfg = config_from_dict({"data": {"prompt_data": "x.jsonl"},
                            "rollout": {"num_rollout": 1, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
                            "train": {"backend": "mock"}, "engine": {"backend": "mock"},
                            "storage": {"storage_options": options}})
    assert "s3cr3t" not in dump_config(cfg) and "AKIA123" not in dump_config(cfg)
    assert yaml.safe_load(dump_config(cfg))["storage"]["storage_options"]["secret"] == REDACTED


def test_megatron_takes_every_algorithm():
    """The train step is shared (engines/train/step.py): nothing is refused for megatron."""
    base = {"data": {"prompt_data": "x.jsonl"}, "rollout": {"num_rollout": 1, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
            "engine": {"backend": "mock"}, "cluster": {"colocate": True},
            "train": {"backend": "megatron", "model_path": "m", "lr_warmup_steps": 10,
                      "lr_decay_style": "cosine", "lr_decay_steps": 20}}
    cfg = config_from_dict({**base, "algorithm": {
        "advantage_estimator": "ppo", "rollout_correction": {"mode": "token_tis"},
        "kl_coef": 0.1, "use_opd": True,
        "opd_teacher_path": "t", "normalize_advantages": True}})
    assert cfg.train.backend == "megatron" and cfg.algorithm.use_opd


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "rloo", "reinforce_plus_plus_baseline"])
def test_a_group_estimator_with_one_sample_per_prompt_is_refused(tmp_path, estimator):
    """Each advantage compares a sample with the others of its prompt: alone, it is 0 and
    nothing is learnt, so the config says what to set instead of training on nothing."""
    with pytest.raises(ConfigError, match=(
            rf"rollout.n_samples_per_prompt: 1 sample per prompt gives every advantage 0 with "
            rf"algorithm.advantage_estimator='{estimator}'.*set rollout.n_samples_per_prompt "
            r"to 2 or more")):
        load_config(write(tmp_path), ["rollout.n_samples_per_prompt=1",
                                      f"algorithm.advantage_estimator={estimator}"])


def test_one_sample_per_prompt_is_fine_where_no_group_is_compared(tmp_path):
    for overrides in (["algorithm.advantage_estimator=reinforce_plus_plus"],
                      ["algorithm.advantage_estimator=ppo"],
                      ["algorithm.loss_type=sft_loss"],  # SFT: no advantages
                      ["algorithm.use_opd=true", "algorithm.opd_teacher_path=teacher"],
                      ["algorithm.custom_advantage_function_path=mine:advantages"]):
        cfg = load_config(write(tmp_path), ["rollout.n_samples_per_prompt=1", *overrides])
        assert cfg.rollout.n_samples_per_prompt == 1


def test_lr_decay_spans_the_whole_run_unless_given():
    """A decaying LR reaches min_lr at the run's last optimizer step by default (TRL's and
    HF's schedules do): rollouts x passes x ceil(rollout samples / global batch)."""
    base = {"data": {"prompt_data": "x.jsonl"},
            "rollout": {"num_rollout": 20, "rollout_batch_size": 128, "n_samples_per_prompt": 8},
            "engine": {"backend": "mock"}, "cluster": {"colocate": True}}
    train = {"backend": "mock", "global_batch_size": 300, "num_epochs_per_rollout": 2,
             "lr_decay_style": "linear"}
    assert config_from_dict({**base, "train": train}).train.lr_decay_steps == 20 * 2 * 4
    by_steps = {**train, "global_batch_size": None, "num_steps_per_rollout": 3}
    assert config_from_dict({**base, "train": by_steps}).train.lr_decay_steps == 20 * 2 * 3
    given = {**train, "lr_decay_steps": 7}
    assert config_from_dict({**base, "train": given}).train.lr_decay_steps == 7
    assert config_from_dict({**base, "train": {**train, "lr_decay_style": "constant"}}
                            ).train.lr_decay_steps is None


def test_overrides_index_lists_as_errors_name_them(tmp_path):
    """`eval.datasets[0].path` is how errors name a key; --set takes the same form (it
    failed with `eval.datasets[0]: Extra inputs are not permitted`)."""
    text = BASE + "eval: {datasets: [{name: a, path: a.jsonl}, {name: b, path: b.jsonl}]}\n"
    cfg = load_config(write(tmp_path, text), [
        "eval.datasets[1].path=other.jsonl", "eval.datasets[2]={name: c, path: c.jsonl}",
        "eval.datasets[0].temperature=0.5",
    ])
    assert [(d.name, os.path.basename(d.path)) for d in cfg.eval.datasets] == [
        ("a", "a.jsonl"), ("b", "other.jsonl"), ("c", "c.jsonl")]
    assert cfg.eval.datasets[0].temperature == 0.5
    with pytest.raises(ConfigError, match=r"eval\.datasets\[5\]: the list has 2 item"):
        load_config(write(tmp_path, text), ["eval.datasets[5].path=x.jsonl"])
    with pytest.raises(ConfigError, match=r"rollout\.num_rollout is not a list"):
        load_config(write(tmp_path, text), ["rollout.num_rollout[0]=1"])
    with pytest.raises(ConfigError, match=r"cannot read the key part 'datasets\[x\]'"):
        load_config(write(tmp_path, text), ["eval.datasets[x].path=a"])


def _megatron(train: dict, cluster: dict | None = None, engine: dict | None = None):
    return config_from_dict({
        "data": {"prompt_data": "x.jsonl"},
        "rollout": {"num_rollout": 1, "rollout_batch_size": 1, "n_samples_per_prompt": 2},
        "engine": engine or {"backend": "mock"}, "cluster": cluster or {},
        "train": {"backend": "megatron", "model_path": "m", **train},
    })


def test_expert_parallel_fits_the_train_group_or_is_refused_by_name(tmp_path):
    cfg = _megatron({"expert_parallel": 2}, {"actor_num_gpus_per_node": 4})
    assert cfg.train.expert_parallel == 2
    with pytest.raises(ConfigError, match=r"train.expert_parallel=2 does not divide the "
                       r"data-parallel size 1 \(2 train ranks"):
        _megatron({"expert_parallel": 2, "pipeline_parallel": 2}, {"actor_num_gpus_per_node": 2})
    with pytest.raises(ConfigError, match="train.expert_parallel=2 needs train.tensor_parallel=1"):
        _megatron({"expert_parallel": 2, "tensor_parallel": 2}, {"actor_num_gpus_per_node": 4})
    with pytest.raises(ConfigError, match=r"train.tensor_parallel=2 x train.pipeline_parallel=1 "
                       "does not divide the 1 train ranks"):
        _megatron({"tensor_parallel": 2})
    with pytest.raises(ConfigError, match="expert parallelism is implemented by "
                       "train.backend=megatron only"):
        load_config(write(tmp_path), ["train.expert_parallel=2"])


def test_engine_expert_parallel_is_sglangs_and_divides_an_engines_gpus():
    cfg = _megatron({"weight_sync": "disk"}, {"rollout_num_gpus_per_engine": 4},
                    {"backend": "sglang", "urls": ["http://h:1"], "expert_parallel": 2})
    assert cfg.engine.expert_parallel == 2
    with pytest.raises(ConfigError, match="engine.expert_parallel=2: the embedded engine holds "
                       "every expert on one device"):
        _megatron({}, None, {"backend": "embedded", "expert_parallel": 2})
    with pytest.raises(ConfigError, match="engine.expert_parallel=4 must divide "
                       "cluster.rollout_num_gpus_per_engine=2"):
        _megatron({"weight_sync": "disk"}, {"rollout_num_gpus_per_engine": 2},
                  {"backend": "sglang", "urls": ["http://h:1"], "expert_parallel": 4})
