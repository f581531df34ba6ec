"""Drafter-training features from an engine directory (`engines.target_features.EngineFeatures`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dspark_export.engines.target_features import EngineFeatures
from dspark_export.errors import ConfigError
from dspark_export.training.features import FeatureCache, build_feature_cache


@pytest.fixture(scope="module")
def engine_features(tiny_engine_dir):
    return EngineFeatures(tiny_engine_dir, threads=1)


@pytest.fixture(scope="module")
def tiny_model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()


def test_engine_features_match_the_transformers_target(engine_features, tiny_model):
    """The fp32 engine's prefill gives the transformers target's tapped outputs and final-normed hidden."""
    tokens = np.random.default_rng(0).integers(3, 256, size=37)
    aux, last = engine_features.features(tokens)
    with torch.no_grad():
        hs = tiny_model(input_ids=torch.from_numpy(tokens)[None], output_hidden_states=True).hidden_states
    taps = engine_features.target_layer_ids
    np.testing.assert_allclose(aux, torch.cat([hs[l + 1][0] for l in taps], -1).numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(last, hs[-1][0].numpy(), atol=1e-4, rtol=1e-4)
    assert aux.shape == (37, len(taps) * engine_features.hidden_size) and last.shape == (37, engine_features.hidden_size)


def test_a_cache_grows_only_from_its_own_source(engine_features, tiny_model, records, tmp_path):
    build_feature_cache(engine_features, records[:3], None, tmp_path, part_size=2)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["source"] == engine_features.name and meta["source"].startswith("engine:fp32:")
    seq = FeatureCache(tmp_path)[2]
    aux, last = engine_features.features(seq.tokens)
    np.testing.assert_allclose(seq.aux, aux, atol=2e-3, rtol=2e-3)  # float16 storage
    np.testing.assert_allclose(seq.last, last, atol=2e-3, rtol=2e-3)
    with pytest.raises(ConfigError, match="source"):
        build_feature_cache(tiny_model, records[:4], engine_features.target_layer_ids, tmp_path, part_size=2,
                            dtype=torch.float32)
    with pytest.raises(ConfigError, match="target_layer_ids"):
        build_feature_cache(engine_features, records[:4], [0], tmp_path, part_size=2)


def test_a_cache_from_before_sources_were_recorded_is_a_transformers_one(engine_features, tiny_model, records,
                                                                         tmp_path):
    import copy

    build_feature_cache(copy.deepcopy(tiny_model), records[:2], engine_features.target_layer_ids, tmp_path,
                        part_size=2, dtype=torch.float32)
    meta = json.loads((tmp_path / "meta.json").read_text())
    del meta["source"]
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match="source is 'transformers' but this run uses 'engine:"):
        build_feature_cache(engine_features, records[:4], None, tmp_path, part_size=2)
    build_feature_cache(copy.deepcopy(tiny_model), records[:4], engine_features.target_layer_ids, tmp_path,
                        part_size=2, dtype=torch.float32)
    assert json.loads((tmp_path / "meta.json").read_text())["source"] == "transformers"
    assert len(FeatureCache(tmp_path)) == 4


def test_the_source_names_the_weights_not_the_folder(engine_features, tiny_engine_dir, tmp_path):
    import shutil

    moved = tmp_path / "renamed"
    shutil.copytree(tiny_engine_dir, moved)
    assert EngineFeatures(moved, threads=1).name == engine_features.name


def test_engine_features_reject_bad_input(engine_features, tmp_path):
    with pytest.raises(ConfigError, match="1 to 512 tokens"):
        engine_features.features([])
    with pytest.raises(ConfigError, match="found 513"):
        engine_features.features(np.zeros(513, np.int64) + 3)
    with pytest.raises(Exception, match="manifest"):
        EngineFeatures(tmp_path)


def test_parallel_workers_write_the_same_cache(engine_features, tiny_engine_dir, records, tmp_path):
    """Two processes, each on every other part, give the single process's cache array for array; a cache
    grown later by one process keeps their parts; a mismatched folder is refused before any process starts."""
    from functools import partial

    from dspark_export.training.features import build_feature_cache_parallel

    build_feature_cache(engine_features, records[:5], None, tmp_path / "one", part_size=2)
    open_source = partial(EngineFeatures, str(tiny_engine_dir), threads=1)
    build_feature_cache_parallel(open_source, records[:5], tmp_path / "two", workers=2, part_size=2)
    one, two = FeatureCache(tmp_path / "one"), FeatureCache(tmp_path / "two")
    assert len(two) == 5 and json.loads((tmp_path / "two" / "meta.json").read_text())["complete"]
    for i in range(5):
        for name in ("tokens", "aux", "last"):
            assert np.array_equal(getattr(one[i], name), getattr(two[i], name))
    stamp = (tmp_path / "two" / "part-00000" / "aux.npy").stat().st_mtime_ns
    build_feature_cache(engine_features, records[:6], None, tmp_path / "two", part_size=2)
    assert len(FeatureCache(tmp_path / "two")) == 6
    assert (tmp_path / "two" / "part-00000" / "aux.npy").stat().st_mtime_ns == stamp
    meta = json.loads((tmp_path / "two" / "meta.json").read_text())
    (tmp_path / "two" / "meta.json").write_text(json.dumps({**meta, "source": "transformers"}))
    with pytest.raises(ConfigError, match="source is 'transformers'"):
        build_feature_cache_parallel(open_source, records[:6], tmp_path / "two", workers=2, part_size=2)


class _ToySource:
    """A picklable feature source for the worker tests: zeros, and a ConfigError on a sequence starting with
    `bad` (as EngineFeatures raises on a sequence it cannot take)."""

    def __init__(self, name="toy", bad=-1):
        self.name, self.bad, self.target_layer_ids, self.hidden_size = name, bad, [0], 4

    def features(self, tokens):
        if int(tokens[0]) == self.bad:
            raise ConfigError("features: a sequence it cannot take")
        return np.zeros((len(tokens), 4), np.float32), np.zeros((len(tokens), 4), np.float32)


def test_a_failing_worker_stops_the_run_and_the_folder_keeps_its_source(records, tmp_path):
    from functools import partial

    from dspark_export.training.features import build_feature_cache_parallel

    rows = [dict(r) for r in records[:8]]
    rows[5]["prompt_ids"] = [999] + list(rows[5]["prompt_ids"])  # part 2 (worker 1 of 2 takes parts 0 and 2)
    with pytest.raises(ConfigError, match=r"features worker 1/2 failed: ConfigError: part-00002: record 'toy' row 5"):
        build_feature_cache_parallel(partial(_ToySource, bad=999), rows, tmp_path, workers=2, part_size=2)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["source"] == "toy" and not meta["complete"]
    assert (tmp_path / "part-00000" / "index.json").is_file() and not (tmp_path / "part-00002").exists()
    with pytest.raises(ConfigError, match="source is 'toy' but this run uses 'other'"):
        build_feature_cache(_ToySource("other"), rows, None, tmp_path, part_size=2)
    rows[5]["prompt_ids"] = rows[5]["prompt_ids"][1:]
    build_feature_cache_parallel(partial(_ToySource), rows, tmp_path, workers=5, part_size=2)  # 4 parts: 4 workers
    assert len(FeatureCache(tmp_path)) == 8


@pytest.mark.parametrize("weights, attention", [("int4", "onnx"), ("int8", "onnx"), ("int4", "cpu")])
def test_the_empty_cache_prefill_keeps_the_engines_bits(build_tiny_engine_dir, weights, attention):
    """On a quantized target with ONNX exact attention the specialised feature graph gives the engine graph's
    features bit for bit, across KEY_CHUNK boundaries (one chunk, exactly one, several); an fp32 target has no
    exact attention and RaggedAttention reads only live entries already: both are left as they are."""
    from tests.conftest import TINY_BUILD

    engine_dir = build_tiny_engine_dir(f"features-{weights}-{attention}",
                                       **{**TINY_BUILD, "weights": weights, "attention_kernel": attention})
    fast, plain = EngineFeatures(engine_dir, threads=1), EngineFeatures(engine_dir, threads=1, specialise=False)
    assert fast.specialised_layers == (fast._layers if attention == "onnx" else 0)
    assert plain.specialised_layers == 0
    assert fast.name == plain.name
    rng = np.random.default_rng(1)
    for length in (1, 5, 127, 128, 129, 300):
        tokens = rng.integers(3, 256, size=length)
        for a, b in zip(fast.features(tokens), plain.features(tokens)):
            assert np.array_equal(a, b), length


def test_an_fp32_target_is_not_specialised(engine_features):
    assert engine_features.specialised_layers == 0
