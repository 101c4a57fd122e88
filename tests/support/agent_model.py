"""A tiny agent model that has learned by heart what to answer, for tests that need a model
to write a tool call (an untrained one never writes valid JSON).

`taught_agent_model` overfits the example's tiny model to a few (messages -> reply) pairs:
full-batch Adam on the replies' tokens only, until greedy decoding reproduces every reply.
The model, tokenizer and chat template stay the real ones the engine and gateway load.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engines.chat.template import encode_text, normalise_messages, render_text
from examples.openai_agent.model import save_agent_model

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
LESSONS: list[tuple[list[dict[str, Any]], str]] = [
    ([{"role": "user", "content": "what is 2+3?"}], CALL),
    ([{"role": "user", "content": "what is 2+3?"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]},
      {"role": "tool", "content": "5"}], "the answer is 5"),
]


def _examples(tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    out = []
    for messages, reply in LESSONS:
        prompt = encode_text(tokenizer, render_text(tokenizer, normalise_messages(messages),
                                                    TOOLS))
        out.append((prompt, encode_text(tokenizer, reply) + [tokenizer.eos_token_id]))
    return out


def taught_agent_model(out_dir: str, max_steps: int = 600) -> str:
    save_agent_model(out_dir + "-random")
    tokenizer = AutoTokenizer.from_pretrained(out_dir + "-random")
    model = AutoModelForCausalLM.from_pretrained(out_dir + "-random")
    examples = _examples(tokenizer)
    width = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), width), tokenizer.pad_token_id)
    labels = torch.full((len(examples), width), -100)
    for i, (p, r) in enumerate(examples):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p): len(p) + len(r)] = torch.tensor(r)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(max_steps):
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 50 == 49 and _recites(model, examples):
            break
    else:
        raise AssertionError(f"the tiny model did not learn its replies (loss {loss.item():.3g})")
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@torch.no_grad()
def _recites(model: Any, examples: list[tuple[list[int], list[int]]]) -> bool:
    model.eval()
    try:
        for prompt, reply in examples:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=len(reply),
                                 do_sample=False)
            if out[0, len(prompt):].tolist() != reply:
                return False
        return True
    finally:
        model.train()
