"""The drafter shipped for the embedded default: small, fp16, drafter-owned tensors only, calibrated."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from dspark_export.modeling.checkpoint import read_drafter_config
from dspark_export.modeling.drafter import SHARED_EMBEDDING_NAMES
from dspark_export.modeling.loading import read_calibration, shipped_drafter_path

SHIPPED = shipped_drafter_path("default")


def test_a_drafter_ships_for_the_default_target():
    assert SHIPPED is not None, "src/dspark_export/assets/drafters/smollm2-135m-instruct/config.json is missing"


@pytest.mark.skipif(SHIPPED is None, reason="no shipped drafter")
def test_shipped_drafter_format():
    cfg = read_drafter_config(SHIPPED)
    assert cfg.is_trained and cfg.model_type == "llama" and cfg.vocab_size == 49152 and cfg.hidden_size == 576
    assert cfg.num_target_layers == 30 and cfg.block_size == 5
    size = sum(p.stat().st_size for p in SHIPPED.iterdir())
    assert size <= 25 * 2**20, f"shipped drafter is {size / 2**20:.1f} MiB (limit 25)"
    with safe_open(str(SHIPPED / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        assert not set(names) & set(SHARED_EMBEDDING_NAMES)
        assert {str(f.get_slice(n).get_dtype()) for n in names} == {"F16"}
    temps = read_calibration(SHIPPED, cfg.block_size)
    assert temps is not None and len(temps) == 5
    info = json.loads((SHIPPED / "calibration.json").read_text())
    assert info["mean_ece_after"] <= info["mean_ece_before"]


def test_calibration_bias_is_read_and_checked(tmp_path):
    from dspark_export.errors import ConfigError
    from dspark_export.modeling.loading import read_calibration_bias

    assert read_calibration_bias(tmp_path, 3) is None                       # no file
    (tmp_path / "calibration.json").write_text(json.dumps({"confidence_temperature": [1, 1, 1]}))
    assert read_calibration_bias(tmp_path, 3) is None                       # temperature-only STS
    (tmp_path / "calibration.json").write_text(json.dumps({"confidence_temperature": [1, 1, 1],
                                                           "confidence_bias": [0.5, -1, 0]}))
    assert read_calibration_bias(tmp_path, 3) == [0.5, -1.0, 0.0]
    for bad in ([0.5, 1.0], [0.5, float("nan"), 0], [True, 0, 0], "0.5"):
        (tmp_path / "calibration.json").write_text(json.dumps({"confidence_bias": bad}))
        with pytest.raises(ConfigError, match="confidence_bias"):
            read_calibration_bias(tmp_path, 3)
    assert read_calibration_bias(SHIPPED, 5) is not None and len(read_calibration_bias(SHIPPED, 5)) == 5
