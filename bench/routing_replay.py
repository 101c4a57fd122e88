"""Train/rollout log-prob mismatch of an MoE model with and without routing replay.

The embedded engine generates in bfloat16 while the trainer scores in float32 (the usual
split on GPUs: bf16 rollout, fp32 master weights): tokens whose router scores are close pick
other experts in the trainer. The figure is `train/rollout_logprob_abs_diff` (mean |trainer's
old log-prob - engine's log-prob| over response tokens, `engines/train/metrics.py`), for the
trainer's own routing and for the engine's replayed one, plus the share of (token, layer)
routings that differ. Results: bench/RESULTS.md, "Routing replay".

    .venv/bin/python -m bench.routing_replay --layers 4 --hidden 128 --prompts 32
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch

from engines.inference.embedded_generator import EmbeddedGenerator
from engines.inference.gen_types import GenRequest, SamplingParams
from engines.train.batching import build_padded_batch
from engines.train.metrics import rollout_logprob_abs_diff
from engines.train.routing_replay import build_replay_batch
from engines.train.torch_models import response_log_probs
from examples.arithmetic.build_model import save_tiny_model
from storage.sample import RoutedExperts, Sample


def measure(model_dir: str, prompts: int, response_len: int, engine_dtype: str,
            device: str = "cpu") -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    gen = EmbeddedGenerator(model_dir, dtype=engine_dtype, device=device)
    params = SamplingParams(max_new_tokens=response_len, ignore_eos=True)
    texts = [f"{i}+{2 * i + 1}=" for i in range(prompts)]
    reqs = [GenRequest(f"r{i}", gen.tokenize(t), SamplingParams(
        max_new_tokens=params.max_new_tokens, ignore_eos=True, sampling_seed=i),
        return_routed_experts=True) for i, t in enumerate(texts)]
    samples = []
    for i, (req, res) in enumerate(zip(reqs, gen.generate(reqs), strict=True)):
        assert res.routed_experts is not None
        samples.append(Sample(
            index=i, group_index=i, tokens=req.input_ids + res.output_ids,
            response_length=len(res.output_ids), loss_mask=[1] * len(res.output_ids),
            rollout_log_probs=res.output_logprobs,
            routed_experts=RoutedExperts.of(res.routed_experts)))
    trainer: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.nn.Module.to(trainer, device)
    layers, topk = trainer.config.num_hidden_layers, trainer.config.num_experts_per_tok
    own_ids: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: own_ids.append(out[2]))
             for layer in trainer.model.layers]
    out = {}
    with torch.no_grad():
        for name, batch in (("own", build_padded_batch(samples, 0)),
                            ("replay", build_replay_batch(samples, 0, (layers, topk)))):
            own_ids.clear()
            batch = batch.to(torch.device(device))
            log_probs = response_log_probs(trainer, batch, 1.0)[0].cpu()
            old = [log_probs[b, : s.response_length] for b, s in enumerate(samples)]
            out[f"logprob_abs_diff_{name}"] = rollout_logprob_abs_diff(samples, list(old))
            if name == "own":
                recorded = build_replay_batch(samples, 0, (layers, topk)).routed_experts
                assert recorded is not None
                mask = torch.zeros(batch.input_ids.shape, dtype=torch.bool)
                own_ids[:] = [ids.cpu() for ids in own_ids]
                for b, s in enumerate(samples):
                    mask[b, : len(s.tokens) - 1] = True
                differ = [
                    (ids.reshape(*mask.shape, topk).sort(-1).values
                     != recorded[:, :, layer].sort(-1).values).any(-1)[mask]
                    for layer, ids in enumerate(own_ids)
                ]
                out["routing_differs"] = float(torch.cat(differ).float().mean())
    for h in hooks:
        h.remove()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--engine-dtype", default="bfloat16")
    parser.add_argument("--device", default="cpu", help="engine and trainer: cpu or cuda")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(os.path.join(tmp, "moe"), args.layers, args.hidden,
                                    family="qwen3_moe")
        result = measure(model_dir, args.prompts, args.response_len, args.engine_dtype,
                         args.device)
    print(" ".join(f"{k}={v:.4g}" for k, v in result.items()))


if __name__ == "__main__":
    main()
