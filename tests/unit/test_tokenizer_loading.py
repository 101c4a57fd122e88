"""`engines.chat.tokenizer`: the generic fast tokenizer is loaded without torch, and it is the
tokenizer AutoTokenizer builds (same ids, same text, same chat template); where
tokenizer_config.json and tokenizer.json leave encode and decode to the `tokenizers` library,
those run without transformers, which a chat template or any other attribute loads. Any
other tokenizer class still goes through AutoTokenizer. The model's context length
(`model_context`) is read without torch too."""

from __future__ import annotations

import json
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engines.chat.tokenizer import (
    TokenizersOnly,
    encode_texts,
    is_generic_tokenizer_dir,
    load_tokenizer,
    plain_backend,
)
from engines.data.prompt_dataset import model_context
from tests.support import REPO_ROOT

TEXTS = ["12+34=", "What is 7 + 8?\n<bos> 15 <eos>", ""]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from examples.arithmetic.build_model import save_tiny_model

    return save_tiny_model(str(tmp_path_factory.mktemp("tok") / "tiny"), num_layers=1, hidden_size=32)


def test_texts_encoded_in_one_call_get_the_ids_of_one_call_each(model_dir: str) -> None:
    """`encode_texts` batches a fast tokenizer's calls: the same ids as `encode` of each text
    (no special tokens, no padding); a tokenizer with only `encode` is called per text."""
    fast = load_tokenizer(model_dir)
    texts = TEXTS * 3 + ["99+1=" * 40]
    want = [fast.encode(t, add_special_tokens=False) for t in texts]
    assert fast.is_fast and encode_texts(fast, texts) == want

    class EncodeOnly:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [len(text), int(add_special_tokens)]

    assert encode_texts(EncodeOnly(), ["ab", ""]) == [[2, 0], [0, 0]]
    assert encode_texts(fast, []) == []


def random_texts(tokenizer, n: int = 300) -> list[str]:
    """Texts of the tokenizer's own pieces, its special tokens among them, and a few
    characters outside its vocabulary."""
    rng = random.Random(0)
    pieces = [*tokenizer.get_vocab(), "é", "\n", "  ", "<eos", "xyz>"]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 24))) for _ in range(n)]


def assert_same_encode_and_decode(ours, auto) -> None:
    rng = random.Random(1)
    for text in [*TEXTS, *random_texts(auto)]:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == auto.encode(
                text, add_special_tokens=special), text
    ids = [[rng.randrange(len(auto)) for _ in range(rng.randint(0, 20))] for _ in range(300)]
    for skip in (True, False):
        assert [ours.decode(i, skip_special_tokens=skip) for i in ids] == [
            auto.decode(i, skip_special_tokens=skip) for i in ids]
        assert ours.batch_decode(ids, skip_special_tokens=skip) == auto.batch_decode(
            ids, skip_special_tokens=skip)
    assert [getattr(ours, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")] == [
        getattr(auto, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")]


def test_the_generic_tokenizer_is_the_one_autotokenizer_builds(model_dir: str) -> None:
    assert is_generic_tokenizer_dir(model_dir)
    ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(ours, TokenizersOnly)
    assert_same_encode_and_decode(ours, auto)
    assert encode_texts(ours, TEXTS) == [auto.encode(t, add_special_tokens=False) for t in TEXTS]
    # the rest is transformers' tokenizer itself
    assert type(ours.transformers_tokenizer()) is type(auto)
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
    chat = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
        chat, tokenize=False)
    assert (ours.eos_token_id, ours.pad_token_id, len(ours)) == (
        auto.eos_token_id, auto.pad_token_id, len(auto))
    # (Ray ships what it holds by pickle)
    again = pickle.loads(pickle.dumps(load_tokenizer(model_dir)))
    assert again.encode("1+2=3") == auto.encode("1+2=3") and again.decode([5, 6]) == auto.decode([5, 6])


def copy_tokenizer(model_dir: str, to: Path, config: dict | None = None,
                   backend: dict | None = None) -> str:
    """`model_dir`'s tokenizer in `to`, its tokenizer_config.json and tokenizer.json updated."""
    to.mkdir()
    for name, changes in (("tokenizer_config.json", config), ("tokenizer.json", backend)):
        data = json.loads(Path(model_dir, name).read_text())
        (to / name).write_text(json.dumps({**data, **(changes or {})}))
    return str(to)


@pytest.mark.parametrize(("config", "backend"), [
    ({"add_bos_token": True, "add_eos_token": True}, None),  # transformers rebuilds the template
    ({"clean_up_tokenization_spaces": True}, None),
    ({"split_special_tokens": True}, None),
    ({"eos_token": "</s>"}, None),  # a special token transformers would add
    (None, {"truncation": {"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                           "stride": 0}}),
    (None, {"post_processor": None}),
], ids=["bos-eos", "clean-up", "split-special", "new-eos", "truncation", "no-post-processor"])
def test_settings_that_change_encode_or_decode_get_transformers_tokenizer(
        model_dir: str, tmp_path: Path, config: dict | None, backend: dict | None) -> None:
    """Each of these makes transformers encode or decode other than tokenizer.json alone
    would (the first adds BOS and EOS to every encode), so the tokenizer is transformers'."""
    path = copy_tokenizer(model_dir, tmp_path / "tok", config, backend)
    ours, auto = load_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert_same_encode_and_decode(ours, auto)
    assert plain_backend(path) is None and type(ours) is type(auto)


def test_loading_it_and_reading_the_context_import_no_torch(model_dir: str) -> None:
    """Nor transformers, until a chat template is asked for."""
    code = ("import sys; from engines.chat.tokenizer import load_tokenizer, encode_texts; "
            "from engines.data.prompt_dataset import model_context; "
            f"t = load_tokenizer({model_dir!r}); print(model_context({model_dir!r})); "
            "t.decode(t.encode('1+2')); t.batch_decode([[5]]); encode_texts(t, ['3']); "
            "t.eos_token_id; print('torch' in sys.modules, 'transformers' in sys.modules); "
            "t.apply_chat_template([{'role': 'user', 'content': '1'}], tokenize=False); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    config = json.loads(Path(model_dir, "config.json").read_text())
    assert out == [str(config["max_position_embeddings"]), "False", "False", "False", "True"]


def test_another_tokenizer_class_goes_through_autotokenizer(model_dir: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other"
    other.mkdir()
    for name in ("tokenizer.json", "config.json"):
        (other / name).write_bytes(Path(model_dir, name).read_bytes())
    config = json.loads(Path(model_dir, "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizerFast"}))
    assert not is_generic_tokenizer_dir(str(other))
    calls: list[str] = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(lambda cls, path: calls.append(path)))
    load_tokenizer(str(other))
    assert calls == [str(other)]


def test_a_config_without_the_key_at_its_top_goes_through_autoconfig(model_dir: str, tmp_path: Path) -> None:
    config = json.loads(Path(model_dir, "config.json").read_text())
    assert model_context(model_dir) == config["max_position_embeddings"]
    del config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    # AutoConfig fills in the model type's default
    from transformers import AutoConfig

    assert model_context(str(tmp_path)) == AutoConfig.from_pretrained(str(tmp_path)).max_position_embeddings
