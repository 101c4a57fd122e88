"""A copy of the tiny model rewired into a two-state bigram model, for flow tests that need
a model to write a known kind of answer (an untrained one writes anything).

Its layers add nothing to the residual stream (o_proj and down_proj zero), so the logits
depend only on the last token, through two one-hot features: "the last token is marked" and
"it is not". After an unmarked token it writes one of `after_unmarked`, after a marked one
one of `after_marked`, each of a set equally likely; any other token has p < 1e-8.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

LOGIT = 24.0  # of the tokens it writes; the others get 0, about e^-24 as likely


def save_bigram_model(tiny_model_dir: str, out: str, marked: list[str],
                      after_unmarked: list[str], after_marked: list[str]) -> str:
    """The rewired copy of `tiny_model_dir` saved at `out`. Token lists are the tokenizer's
    tokens; its EOS token may be named by `eos_token`'s text."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tokenizer.convert_tokens_to_ids
    hidden = model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        embed[:, 0] = 1.0  # feature 0: the last token is not marked
        embed[ids(marked), 0], embed[ids(marked), 1] = 0.0, 1.0  # feature 1: it is
        head.zero_()  # RMSNorm scales a one-hot feature to sqrt(hidden)
        head[ids(after_unmarked), 0] = LOGIT / hidden**0.5
        head[ids(after_marked), 1] = LOGIT / hidden**0.5
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
