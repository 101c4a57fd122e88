"""FSDP2's pieces that need no process group: which modules become FSDP units, the padding
that keeps the ranks' forwards in step, and the config it is refused with."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from engines.train.fsdp import decoder_layers, pad_micro_batches
from engines.train.step_model import MicroBatch
from flows.config.run import TrainConfig


def test_every_decoder_layer_is_a_unit(tiny_model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    layers = decoder_layers(model)
    assert layers == list(model.model.layers) and len(layers) == 2


def test_fewer_micro_batches_are_padded_with_uncounted_stand_ins() -> None:
    mine = [MicroBatch([3, 5]), MicroBatch([7])]
    padded = pad_micro_batches(mine, 4)
    assert padded[:2] == mine
    assert padded[2:] == [MicroBatch([3, 5], counted=False)] * 2
    assert pad_micro_batches(mine, 2) == mine


@pytest.mark.parametrize(("settings", "message"), [
    ({"backend": "megatron", "strategy": "fsdp2"}, "train.strategy=fsdp2 is the torch trainer's"),
    ({"fsdp_cpu_offload": True}, "train.fsdp_cpu_offload needs train.strategy=fsdp2"),
    ({"strategy": "fsdp2", "lora": {"rank": 8}, "model_path": "m"}, "with train.lora"),
])
def test_settings_fsdp2_cannot_honour_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainConfig.model_validate(settings)


def test_gpu_ranks_with_cpu_offloaded_shards_also_get_gloo() -> None:
    """NCCL alone cannot reduce the CPU shards' gradient norm (found on 2 H200s: "No backend
    type associated with device type cpu"); a torch-parsable backend string adds gloo."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    from engines.train.distributed import process_group_backend

    assert process_group_backend(cuda=False, cpu_collectives=True) == "gloo"
    assert process_group_backend(cuda=True, cpu_collectives=False) == "nccl"
    both = process_group_backend(cuda=True, cpu_collectives=True)
    assert BackendConfig(Backend(both)).get_device_backend_map() == {"cpu": "gloo",
                                                                     "cuda": "nccl"}
