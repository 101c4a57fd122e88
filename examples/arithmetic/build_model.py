"""Build the example's tiny Llama and character tokenizer from scratch, in HF format.

No weights can be downloaded here, so the example makes its own: a character-level
tokenizer (the `tokenizers` library, wrapped as a `PreTrainedTokenizerFast`) and a randomly
initialised 4-layer Llama (or Qwen3, or Qwen3-MoE with 8 experts, 2 per token: `--family`,
the families rollflow trains; docs/models.md). Both are saved with `save_pretrained` and everything downstream
loads them with `from_pretrained`, exactly as it would load a hub model.
"""

from __future__ import annotations

import argparse
import os

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARACTERS = list("0123456789+-*=?:,. abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ\n")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "artifacts", "tiny-llama")


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_heads: int = 4,
    max_positions: int = 128,
    seed: int = 0,
    family: str = "llama",
) -> torch.nn.Module:
    torch.manual_seed(seed)
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    config: PretrainedConfig
    if family == "llama":
        config = LlamaConfig(intermediate_size=hidden_size * 4, **common)
    elif family == "qwen2":
        config = Qwen2Config(intermediate_size=hidden_size * 4, **common)
    elif family == "qwen3":
        config = Qwen3Config(intermediate_size=hidden_size * 4, head_dim=hidden_size // num_heads,
                             **common)
    elif family == "qwen3_moe":
        config = Qwen3MoeConfig(
            intermediate_size=hidden_size * 4, moe_intermediate_size=hidden_size,
            head_dim=hidden_size // num_heads, num_experts=8, num_experts_per_tok=2,
            norm_topk_prob=True, router_aux_loss_coef=0.001, **common,
        )
    else:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny_model(
    out_dir: str, num_layers: int = 4, hidden_size: int = 128, seed: int = 0,
    family: str = "llama", max_positions: int = 128,
) -> str:
    """Write tokenizer + model to `out_dir` (idempotent: reuses an existing one)."""
    if os.path.exists(os.path.join(out_dir, "config.json")):
        return out_dir
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, num_layers=num_layers, hidden_size=hidden_size, seed=seed,
                        family=family, max_positions=max_positions)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="directory to write (default: this example's artifacts/tiny-llama, "
                        "wherever the command runs from)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--family", choices=FAMILIES, default="llama", help="model family")
    parser.add_argument("--max-positions", type=int, default=128,
                        help="context length in tokens (prompt + response; a multi-turn "
                        "agent needs more than the default)")
    args = parser.parse_args()
    out = save_tiny_model(os.path.abspath(args.out), args.layers, args.hidden, args.seed,
                          args.family, args.max_positions)
    print(out)


if __name__ == "__main__":
    main()
