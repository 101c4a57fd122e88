"""`engines.chat.tokenizer`: the generic fast tokenizer is loaded without torch, and it is the
tokenizer AutoTokenizer builds (same class, same ids, same chat template); any other
tokenizer class still goes through AutoTokenizer. The model's context length
(`model_context`) is read without torch too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engines.chat.tokenizer import encode_texts, is_generic_tokenizer_dir, load_tokenizer
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


def test_the_generic_tokenizer_is_the_one_autotokenizer_builds(model_dir: str) -> None:
    assert is_generic_tokenizer_dir(model_dir)
    ours, auto = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
    chat = [{"role": "user", "content": "1+2"}, {"role": "assistant", "content": "3"}]
    assert ours.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
        chat, tokenize=False)
    assert (ours.eos_token_id, ours.pad_token_id, len(ours)) == (
        auto.eos_token_id, auto.pad_token_id, len(auto))


def test_loading_it_and_reading_the_context_import_no_torch(model_dir: str) -> None:
    code = ("import sys; from engines.chat.tokenizer import load_tokenizer; "
            "from engines.data.prompt_dataset import model_context; "
            f"load_tokenizer({model_dir!r}); print(model_context({model_dir!r})); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    config = json.loads(Path(model_dir, "config.json").read_text())
    assert out == [str(config["max_position_embeddings"]), "False"]


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
