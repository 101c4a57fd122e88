"""train.deterministic on a busy machine: the torch trainer's step, taken again from the same
state beside CPU burners, ends with the same weights bit for bit.

The batch has the main job's shape: groups of 8 responses share a prompt, so the gather of
the response logits reads each prompt's last position 8 times, and its backward adds 8
gradients into one element. Without torch's deterministic kernels that backward adds with
atomic float adds from each of the 2 threads' share of the batch; 65 groups put one group
across the two shares, and beside burners the order of its adds followed the threads'
timing (this test failed 2 of 2 times so; bench/RESULTS.md, "Busy machine")."""

from __future__ import annotations

import torch

from engines.train.torch_backend import TorchTrainBackend
from flows.config.run import AlgorithmConfig, TrainConfig
from tests.support.procs import cpu_burner
from tests.support.samples import grouped_samples

RUNS = 6


def trained_weights(model_dir: str) -> dict[str, torch.Tensor]:
    """One step of a fresh backend (2 threads, deterministic) on the same batch."""
    cfg = TrainConfig.model_validate({
        "model_path": model_dir, "lr": 1e-3, "seed": 7, "deterministic": True,
        "global_batch_size": 65 * 8})
    backend = TorchTrainBackend(cfg, AlgorithmConfig(), num_threads=2)
    backend.train(grouped_samples(groups=65, per_group=8), 0)
    return {k: v.detach().clone() for k, v in backend.model.state_dict().items()}


def test_a_deterministic_train_step_is_bitwise_the_same_beside_burners(
    tiny_model_dir: str,
) -> None:
    try:
        with cpu_burner(processes=4):
            runs = [trained_weights(tiny_model_dir) for _ in range(RUNS)]
    finally:  # the backend set it for its process, which is this test worker
        torch.use_deterministic_algorithms(False)
    differing = [sorted(k for k in runs[0] if not torch.equal(runs[0][k], run[k]))
                 for run in runs[1:]]
    assert differing == [[]] * (RUNS - 1), f"tensors that differ from run 0: {differing}"
