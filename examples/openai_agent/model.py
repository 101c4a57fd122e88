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

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from examples.arithmetic.build_model import CHARACTERS, SPECIAL_TOKENS, build_model

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="examples/openai_agent/artifacts/tiny-agent")
    args = parser.parse_args()
    print(save_agent_model(args.out))


if __name__ == "__main__":
    main()
