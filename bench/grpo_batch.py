"""The random GRPO batch that bench.megatron_grpo trains on and bench.packing lays out: groups
of responses to one prompt each, response lengths drawn as `LENGTHS` says."""

from __future__ import annotations

import argparse
import random

from storage.sample import Sample

VOCAB = 151936  # Qwen2's and Qwen3's: token ids of bench.megatron_grpo's model shapes

LENGTHS = {  # response lengths up to R: `--lengths`
    "half": "uniform in [R/2, R]: padded micro-batches of similar lengths",
    "uniform": "uniform in [1, R]",
    "longtail": "exponential of mean R/4, capped at R (2% reach it): many short, a few long, "
                "as RL responses run",
}


def response_length(rng: random.Random, resp_len: int, lengths: str) -> int:
    """One response length up to `resp_len` drawn as `LENGTHS[lengths]` says."""
    if lengths == "half":
        return rng.randint(resp_len // 2, resp_len)
    if lengths == "uniform":
        return rng.randint(1, resp_len)
    if lengths == "longtail":
        return min(resp_len, max(1, round(rng.expovariate(4 / resp_len))))
    raise ValueError(f"lengths: one of {sorted(LENGTHS)}, not {lengths!r}")


def make_samples(
    n_groups: int, group: int, prompt_len: int, resp_len: int, lengths: str = "half"
) -> list[Sample]:
    rng = random.Random(0)
    samples = []
    for g in range(n_groups):
        prompt = [rng.randrange(VOCAB) for _ in range(prompt_len)]
        for j in range(group):
            r = response_length(rng, resp_len, lengths)
            samples.append(Sample(
                index=g * group + j, group_index=g, tokens=prompt + [rng.randrange(VOCAB) for _ in range(r)],
                response_length=r, loss_mask=[1] * r, reward=float(rng.random() > 0.5),
            ))
    return samples


def add_batch_arguments(
    parser: argparse.ArgumentParser, groups: int, prompt_len: int, response_len: int
) -> None:
    """The batch's flags, for `make_samples(args.groups, args.group_size, args.prompt_len,
    args.response_len, args.lengths)`; the defaults are each bench's."""
    parser.add_argument("--groups", type=int, default=groups)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=prompt_len)
    parser.add_argument("--response-len", type=int, default=response_len)
    parser.add_argument("--lengths", choices=sorted(LENGTHS), default="half",
                        help="response lengths: " + "; ".join(f"{k}: {v}" for k, v in LENGTHS.items()))
