"""Session-scoped tiny random models (no downloads). See tests/models/registry.py for what exists."""

from __future__ import annotations

import pytest
import torch


TINY_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=4,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)


def make_tiny_target(model_type: str, seed: int = 0, **dims):
    """A tiny random transformers causal LM (fp32, eval mode) of the given ``model_type``; `dims` override
    TINY_DIMS."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    extra = {"rope_theta": 10000.0}
    config = AutoConfig.for_model(model_type, **{**TINY_DIMS, **dims}, tie_word_embeddings=False, **extra)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = 1, 2, 2
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is small; widen the weights so logits have real spread (near-ties are rare).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_target("llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3():
    return make_tiny_target("qwen3", seed=1)


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny_target(request):
    return make_tiny_target(request.param, seed=2)


TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_tokenizer(vocab_size: int = 256):
    """A character-level fast tokenizer over `vocab_size` ids (0 unk, 1 bos, 2 eos = <|im_end|>, 3 <|im_start|>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = specials + chars
    vocab += [f"<extra_{i}>" for i in range(vocab_size - len(vocab))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|im_(start|end)\|>|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    """A saved tiny Llama target folder (config.json, model.safetensors, tokenizer with chat template)."""
    path = tmp_path_factory.mktemp("tiny_llama_target")
    model = make_tiny_target("llama", seed=3)
    model.save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def fake_tensorrt(monkeypatch):
    """Install stand-in ``tensorrt`` and ``tensorrt.plugin`` modules for one test (never a real TensorRT).

    ``fake_tensorrt(version="10.16.0.1", plugin=dict(...) | None)`` puts a ``tensorrt`` module with a
    ``Builder`` and that ``__version__`` into ``sys.modules``; ``plugin`` gives the attributes of
    ``tensorrt.plugin`` (None: the submodule does not import). The cached TensorRT availability check is
    cleared before and after, so the stand-ins are seen and never outlive the test. Returns the module.
    """
    import sys
    import types

    from dspark_export.engines.trt import tensorrt_unavailable_reason

    def install(version: str = "10.16.0.1", plugin: dict | None = None):
        trt = types.ModuleType("tensorrt")
        trt.__version__ = version
        trt.Builder = type("Builder", (), {})
        monkeypatch.setitem(sys.modules, "tensorrt", trt)
        if plugin is None:
            monkeypatch.setitem(sys.modules, "tensorrt.plugin", None)  # `import tensorrt.plugin` raises ImportError
        else:
            trtp = types.ModuleType("tensorrt.plugin")
            for name, value in plugin.items():
                setattr(trtp, name, value)
            trt.plugin = trtp
            monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
        tensorrt_unavailable_reason.cache_clear()
        return trt

    tensorrt_unavailable_reason.cache_clear()
    yield install
    monkeypatch.undo()
    tensorrt_unavailable_reason.cache_clear()


@pytest.fixture(scope="session")
def build_tiny_engine_dir(tiny_target_dir, tmp_path_factory):
    """Factory: `build_tiny_engine_dir(name, **build)` builds the tiny Llama (`tiny_target_dir`) with an
    untrained drafter into a fresh `<tmp>/<name>/tiny` engine directory; `build` are BuildConfig fields
    (buckets, max_context, block_size, ...). Weights are fp32 unless `weights` is given (tests that hold the
    engines to transformers' outputs or lower them for TensorRT need the float graph; the quantized formats
    have their own tests in tests/exporter/test_quantize.py)."""
    from dspark_export.pipeline import BuildConfig, build_engine_dir

    def build(name: str, **config):
        config.setdefault("weights", "fp32")
        out = tmp_path_factory.mktemp(name) / "tiny"
        build_engine_dir(BuildConfig(out=out, target=str(tiny_target_dir), drafter="untrained", **config))
        return out

    return build


#: Build of the tiny engines that test_pipeline.py and tests/serve share (γ = 4, buckets up to 64 tokens).
TINY_BUILD = dict(target_buckets=(1, 2, 4, 8, 16, 32, 64), request_buckets=(1, 2, 4), max_context=96,
                  profile_context=16, profile_repeats=2, block_size=4, markov_rank=8)


@pytest.fixture(scope="session")
def tiny_engine_dir(build_tiny_engine_dir):
    """The tiny Llama built with `TINY_BUILD` (fp32, untrained drafter), once per session for every test that
    only reads it (tests that alter an engine directory copy it first)."""
    return build_tiny_engine_dir("engines", **TINY_BUILD)


# Bucket list of the real-model build: the default's without 256 (no real-model test packs more than 128
# tokens in one target pass), and 3 timed profile runs instead of 10, to keep the build near a minute on 2 cores.
REAL_BUILD_ARGS = ("--profile-repeats", "3", "--target-buckets", "1,2,4,8,16,32,64,128")


@pytest.fixture(scope="session")
def real_engine_dir(tmp_path_factory):
    """An engine directory of the embedded default (SmolLM2-135M-Instruct and its shipped drafter), shared by
    every `real_model` test of the session: `dspark-export build` with no --target/--drafter (whatever the
    default build is), built once; or `$DSPARK_ENGINE_DIR` when set, an existing directory of that build
    (saves the build). Tests only read it."""
    import os
    from pathlib import Path

    from dspark_export.cli import main as cli_main
    from dspark_export.engines.manifest import Manifest

    given = os.environ.get("DSPARK_ENGINE_DIR")
    if given:
        path = Path(given)
        if not (path / "manifest.json").is_file():
            pytest.fail(f"DSPARK_ENGINE_DIR={given}: no manifest.json there; expected an engine directory of "
                        "`dspark-export build` (unset DSPARK_ENGINE_DIR to build one)", pytrace=False)
        if not Manifest.load(path).data["source"]["target"].get("embedded_default"):
            pytest.fail(f"DSPARK_ENGINE_DIR={given}: its target is not the embedded default (SmolLM2); the "
                        "real-model tests expect `dspark-export build` without --target", pytrace=False)
        return path
    out = tmp_path_factory.mktemp("real") / "smollm2"
    assert cli_main(["build", "--out", str(out), *REAL_BUILD_ARGS]) == 0
    return out
