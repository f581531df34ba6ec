"""Which loader reads an engine directory's tokenizer, and that the direct one matches AutoTokenizer."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import transformers

from dspark_export.errors import EngineDirError
from dspark_export.runtime import api

from ..conftest import make_tiny_tokenizer


def _engines(root):
    manifest = SimpleNamespace(data={"tokenizer": {"path": "tokenizer"}}, path_of=lambda rel, what: root / rel)
    return SimpleNamespace(manifest=manifest)


@pytest.fixture()
def saved(tmp_path):
    make_tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    return tmp_path


def _set_class(root, name):
    path = root / "tokenizer" / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = name
    path.write_text(json.dumps(config))


def test_backend_class_is_loaded_directly_and_matches_autotokenizer(saved, monkeypatch):
    reference = transformers.AutoTokenizer.from_pretrained(str(saved / "tokenizer"), local_files_only=True)
    calls = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(a))
    tok = api._load_tokenizer(_engines(saved))
    assert calls == [] and isinstance(tok, transformers.PreTrainedTokenizerFast)
    messages = [{"role": "user", "content": "What is 2+3?"}]
    for text in ["hello world", "<|im_start|>x<|im_end|>", ""]:
        assert tok.encode(text) == reference.encode(text)
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.eos_token_id == reference.eos_token_id and len(tok) == len(reference)


@pytest.mark.parametrize("name", ["LlamaTokenizer", "Qwen2Tokenizer", None])
def test_model_specific_class_goes_through_autotokenizer(saved, monkeypatch, name):
    _set_class(saved, name)
    calls = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda path, **kwargs: calls.append(path) or "auto")
    assert api._load_tokenizer(_engines(saved)) == "auto"
    assert calls == [str(saved / "tokenizer")]


def test_unreadable_tokenizer_is_an_engine_dir_error(saved):
    (saved / "tokenizer" / "tokenizer.json").write_text("{not json")
    with pytest.raises(EngineDirError, match=r"tokenizer: could not load the tokenizer"):
        api._load_tokenizer(_engines(saved))
    shutil.rmtree(saved / "tokenizer")
    with pytest.raises(EngineDirError, match=r"tokenizer: could not load the tokenizer"):
        api._load_tokenizer(_engines(saved))
