"""A tiny model taught by heart to play `sum_retry` on "2+3=": first "4" (wrong), then, told
"wrong, try again", "5"; so a greedy episode takes two turns and earns 0.5. Its logits are
then scaled down (`softness`), which keeps every greedy choice and flattens the sampled ones:
at temperature 1 episodes of one task stray (other replies, rewards and turn counts), so a
GRPO group has something to learn from."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from examples.openai_agent.model import Lesson, save_agent_model, teach
from tests.support.verifiers_envs.sum_retry import RETRY

LESSONS: list[Lesson] = [
    ([{"role": "user", "content": "2+3="}], "4"),
    ([{"role": "user", "content": "2+3="}, {"role": "assistant", "content": "4"},
      {"role": "user", "content": RETRY}], "5"),
]


def taught_sum_retry_model(out_dir: str, softness: float = 0.4) -> str:
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    teach(save_agent_model(out_dir + "-random"), out_dir + "-taught", LESSONS, [])
    model = AutoModelForCausalLM.from_pretrained(out_dir + "-taught")
    with torch.no_grad():
        model.lm_head.weight.mul_(softness)  # untied, no bias: logits scale, argmax stays
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(out_dir + "-taught").save_pretrained(out_dir)
    return out_dir
