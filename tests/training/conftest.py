"""Fixtures for tests/training: a wrapped tiny target, fake response records and their feature cache."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from dspark_export.modeling.target import wrap_target


@pytest.fixture(scope="session")
def train_target(tiny_qwen3):
    return wrap_target(copy.deepcopy(tiny_qwen3), source="tiny qwen3")


@pytest.fixture(scope="session")
def records():
    rng = np.random.default_rng(0)
    out = []
    for i in range(10):
        prompt = rng.integers(3, 256, size=int(rng.integers(4, 12))).tolist()
        # a repetitive "response" so a drafter can learn something in a few steps
        period = rng.integers(3, 256, size=3).tolist()
        response = (period * 20)[: int(rng.integers(20, 40))]
        out.append({"dataset": "toy", "row": i, "temperature": 0.0, "prompt_ids": prompt, "response_ids": response})
    return out


@pytest.fixture(scope="session")
def feature_cache(train_target, records, tmp_path_factory):
    import torch

    from dspark_export.modeling.config import default_target_layer_ids
    from dspark_export.training.features import FeatureCache, build_feature_cache

    folder = tmp_path_factory.mktemp("features")
    ids = default_target_layer_ids(train_target.config.num_hidden_layers)
    build_feature_cache(copy.deepcopy(train_target.model), records, ids, folder, part_size=4, dtype=torch.float32)
    return FeatureCache(folder)
