"""The agent example's tiny model: the arithmetic example's Llama with a tokenizer that can
write tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the Hermes /
Qwen2.5 format the engine and the gateway parse) and a chat template that renders tools, tool
calls and tool results the way Qwen's does, in fewer characters.

Every message ends with `<eos>` and a newline, so an assistant turn the model ended with
`<eos>` continues, token for token, into the next turn's prompt.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from engines.chat.template import encode_text, normalise_messages, render_text
from examples.arithmetic.build_model import CHARACTERS, SPECIAL_TOKENS, build_model

Lesson = tuple[list[dict[str, Any]], str]  # (messages, the assistant's reply text)

TOOL_CHARACTERS = list('<>{}"_/[]()')
CHAT_TEMPLATE = (
    "{%- if tools %}system: tools "
    "{%- for t in tools %} {{ t['function']['name'] }}{%- endfor %}<eos>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}assistant: {{ m['content'] or '' }}"
    "{%- for c in m['tool_calls'] or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{%- endfor %}<eos>\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}<eos>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}assistant: {% endif %}"
)


def build_agent_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS + TOOL_CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>",
                                 eos_token="<eos>", unk_token="<unk>")
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_agent_model(out_dir: str, num_layers: int = 2, hidden_size: int = 64,
                     max_positions: int = 512, seed: int = 0) -> str:
    """Write tokenizer + random model to `out_dir` (reuses an existing one)."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    tokenizer = build_agent_tokenizer()
    model = build_model(tokenizer, num_layers=num_layers, hidden_size=hidden_size,
                        max_positions=max_positions, seed=seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def teach(model_dir: str, out_dir: str, lessons: list[Lesson], tools: list[dict[str, Any]],
          max_steps: int = 1000, lr: float = 3e-3) -> str:
    """A warm start by heart: full-batch Adam on the replies' tokens (each ended by `<eos>`)
    until greedy decoding gives every reply back; the taught model is saved to `out_dir`."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    examples = [
        (encode_text(tokenizer, render_text(tokenizer, normalise_messages(m), tools)),
         encode_text(tokenizer, reply) + [tokenizer.eos_token_id])
        for m, reply in lessons
    ]
    width = max(len(p) + len(r) for p, r in examples)
    ids = torch.full((len(examples), width), tokenizer.pad_token_id)
    labels = torch.full((len(examples), width), -100)
    for i, (p, r) in enumerate(examples):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        labels[i, len(p): len(p) + len(r)] = torch.tensor(r)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for step in range(max_steps):
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        if step % 50 == 49 and _recites(model, examples):
            break
    else:
        raise RuntimeError(f"the model did not learn its {len(lessons)} replies in {max_steps} "
                           f"steps (loss {loss.item():.3g})")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="examples/openai_agent/artifacts/tiny-agent")
    args = parser.parse_args()
    print(save_agent_model(args.out))


if __name__ == "__main__":
    main()
