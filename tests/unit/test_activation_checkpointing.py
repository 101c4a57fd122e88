"""`train.activation_checkpointing`: each decoder layer of the actor runs its forward again in
the backward (so its activations were not kept), the parameter names stay the HF model's,
and the step trains the same weights as without it."""

from __future__ import annotations

import torch

from tests.support.samples import grouped_samples, make_backend


def _train(model_dir: str, checkpointing: bool) -> tuple[int, dict[str, torch.Tensor], list[str]]:
    """Forwards of the first decoder layer in one train step, the weights after it, and the
    parameter names."""
    backend = make_backend(model_dir, activation_checkpointing=checkpointing,
                           global_batch_size=16)
    calls = []
    # a pre-hook of a submodule: the layer's recompute calls its forward, not its hooks, and
    # stops once it has every tensor the backward needs (before the MLP's end)
    backend.model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    backend.train(grouped_samples(groups=8, per_group=4), 0)
    names = [n for n, _ in backend.model.named_parameters()]
    return len(calls), {k: v.detach().clone() for k, v in backend.model.state_dict().items()}, names


def test_layers_recompute_in_the_backward_and_train_the_same(tiny_model_dir: str) -> None:
    plain_calls, plain, plain_names = _train(tiny_model_dir, False)
    calls, weights, names = _train(tiny_model_dir, True)
    assert calls > plain_calls, (calls, plain_calls)  # one more forward per trained micro-batch
    assert names == plain_names
    for name in plain:
        torch.testing.assert_close(weights[name], plain[name], atol=1e-6, rtol=0, msg=name)
