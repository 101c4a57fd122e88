"""Loading a model's tokenizer without importing torch.

`AutoTokenizer.from_pretrained` goes through transformers' config classes, which import
torch: about 2.7 s of CPU in a process that has neither (the rollout actor, a mock engine,
the driver's preflight), against 0.8 s for the same tokenizer loaded as the generic fast
tokenizer. Every run starts such processes, so the generic class is loaded directly where
the directory's tokenizer_config.json names it; a model-specific class (Qwen2Tokenizer,
...), a hub id or anything unusual still goes through AutoTokenizer, so the object is the
one transformers would build. Figures: bench/RESULTS.md, "CI cost".
"""

from __future__ import annotations

import json
import os
from typing import Any

# tokenizer_config.json classes that are the plain `tokenizers` backend (transformers 5
# names it TokenizersBackend; older saves say PreTrainedTokenizerFast)
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`tokenizer.encode(text, add_special_tokens=False)` of each text: in one batch call
    where the tokenizer is a fast (Rust) one, whose Python around each `encode` was most of
    the cost of an SFT step's 6,400 prompts and labels (bench/RESULTS.md, "The main job")."""
    if texts and getattr(tokenizer, "is_fast", False):
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def read_json_object(path: str) -> dict[str, Any] | None:
    """The JSON object in `path`; None if it is missing, unreadable or not an object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_generic_tokenizer_dir(path: str) -> bool:
    """A local directory whose tokenizer is the generic fast one, saved as tokenizer.json."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return False
    config = read_json_object(os.path.join(path, "tokenizer_config.json"))
    return config is not None and config.get("tokenizer_class") in GENERIC_CLASSES


def load_tokenizer(path: str) -> Any:
    """The tokenizer AutoTokenizer.from_pretrained(path) gives, without torch where the
    directory holds the generic fast tokenizer."""
    if is_generic_tokenizer_dir(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
