"""Loading a model's tokenizer without importing torch, and for encode and decode alone
without importing transformers.

`AutoTokenizer.from_pretrained` goes through transformers' config classes, which import
torch: about 2.7 s of CPU in a process that has neither (the rollout actor, a mock engine,
the driver's preflight), against 0.8 s for the same tokenizer loaded as the generic fast
tokenizer. Every run starts such processes, so the generic class is loaded directly where
the directory's tokenizer_config.json names it; a model-specific class (Qwen2Tokenizer,
...), a hub id or anything unusual still goes through AutoTokenizer, so the object is the
one transformers would build.

Most of the generic tokenizer's 0.8 s is transformers' own import (about 1 CPU-s: it scans
the `__all__` of its 1,667 model files), and a run's rollout actor and mock engine only
encode and decode. Where transformers would hand those to the `tokenizers` library
unchanged (`plain_backend`), `TokenizersOnly` does so itself and loads transformers' tokenizer
only for the rest (a chat template, saving, ...). Figures: bench/RESULTS.md, "CI cost".
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# tokenizer_config.json classes that are the plain `tokenizers` backend (transformers 5
# names it TokenizersBackend; older saves say PreTrainedTokenizerFast)
GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def encode_texts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """`tokenizer.encode(text, add_special_tokens=False)` of each text: in one batch call
    where the tokenizer is a fast (Rust) one, whose Python around each `encode` was most of
    the cost of an SFT step's 6,400 prompts and labels (bench/RESULTS.md, "The main job")."""
    if isinstance(tokenizer, TokenizersOnly):
        return tokenizer.encode_batch(texts)
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


# tokenizer_config.json keys that change nothing transformers' encode or decode does beyond
# what tokenizer.json says (`plain_backend`); any other key (add_bos_token,
# split_special_tokens, clean_up_tokenization_spaces true, ...) and the tokenizer is
# transformers' own
PLAIN_CONFIG_KEYS = frozenset({
    "backend", "tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token",
    "model_max_length", "added_tokens_decoder", "chat_template", "model_input_names",
    "padding_side", "truncation_side", "clean_up_tokenization_spaces",
})
NAMED_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# above this many tokens transformers may rewrite the pre-tokenizer's regex (its
# `_patch_mistral_regex`, TokenizersBackend.__init__)
MISTRAL_PATCH_VOCAB = 100_000


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken's dict."""
    return value.get("content") if isinstance(value, dict) else value


def plain_backend(path: str) -> tuple[dict[str, str], Tokenizer] | None:
    """The named special tokens (bos_token -> text) and the `tokenizers` library's tokenizer of
    a generic tokenizer directory whose encode and decode transformers leaves to that library
    as tokenizer.json defines them: no key of tokenizer_config.json that changes them, no
    truncation or padding, its own post-processor, every special token already one of its
    added tokens (transformers would add a missing one), no vocabulary large enough for
    transformers' Mistral regex patch. None otherwise."""
    if not is_generic_tokenizer_dir(path):
        return None
    config = read_json_object(os.path.join(path, "tokenizer_config.json")) or {}
    if (not set(config) <= PLAIN_CONFIG_KEYS
            or config.get("clean_up_tokenization_spaces", False) is not False):
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    except Exception:  # (transformers' own load names what is wrong with it)
        return None
    if (backend.truncation is not None or backend.padding is not None
            or backend.post_processor is None or backend.get_vocab_size() > MISTRAL_PATCH_VOCAB):
        return None
    added = {(i, t.content) for i, t in backend.get_added_tokens_decoder().items() if t.special}
    named = {key: _token_text(config[key]) for key in NAMED_TOKENS if config.get(key)}
    declared = {(int(i), _token_text(t)) for i, t in (config.get("added_tokens_decoder") or {}).items()}
    if not declared <= added or not set(named.values()) <= {text for _, text in added}:
        return None
    if not all(isinstance(text, str) for text in named.values()):
        return None
    return named, backend  # type: ignore[return-value]


def generic_transformers_tokenizer(path: str) -> Any:
    """The generic fast tokenizer of `path` as transformers builds it (AutoTokenizer's class
    for it), without AutoTokenizer's config classes and torch."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path)


class TokenizersOnly:
    """The generic fast tokenizer's `encode`, `decode`, `batch_decode` and special-token ids
    through the `tokenizers` library alone, as transformers' own calls them for a directory
    `plain_backend` accepts; any other attribute, or another form of those calls, loads the
    tokenizer transformers builds (once) and asks it."""

    is_fast = True

    def __init__(self, path: str, named_tokens: dict[str, str], backend: Tokenizer) -> None:
        self.name_or_path = path
        self._backend = backend
        self._named = named_tokens
        self._transformers: Any = None

    def transformers_tokenizer(self) -> Any:
        """The tokenizer `AutoTokenizer.from_pretrained` builds for the directory."""
        if self._transformers is None:
            self._transformers = generic_transformers_tokenizer(self.name_or_path)
        return self._transformers

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # (pickle and copy probe for dunders before __dict__ is set)
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)

    def __len__(self) -> int:
        return len(self.transformers_tokenizer())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.transformers_tokenizer()(*args, **kwargs)

    def _token_id(self, key: str) -> int | None:
        text = self._named.get(key)
        return None if text is None else self._backend.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self._token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._token_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._token_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._token_id("unk_token")

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs or not isinstance(text, str):
            return self.transformers_tokenizer().encode(
                text, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Each text's `encode(text, add_special_tokens)`, in one call."""
        encoded = self._backend.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encoded]

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        if kwargs or not _is_id_list(token_ids):
            return self.transformers_tokenizer().decode(
                token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False,
                     **kwargs: Any) -> list[str]:
        if kwargs or not isinstance(sequences, list | tuple) or not all(
                _is_id_list(ids) for ids in sequences):
            return self.transformers_tokenizer().batch_decode(
                sequences, skip_special_tokens=skip_special_tokens, **kwargs)
        return [self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
                for ids in sequences]


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and all(type(i) is int for i in value)


def load_tokenizer(path: str) -> Any:
    """The tokenizer AutoTokenizer.from_pretrained(path) gives, without torch where the
    directory holds the generic fast tokenizer, and without transformers until more than
    encode and decode is asked of it where `plain_backend` accepts the directory."""
    plain = plain_backend(path)
    if plain is not None:
        return TokenizersOnly(path, *plain)
    if is_generic_tokenizer_dir(path):
        return generic_transformers_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
