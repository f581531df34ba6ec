"""The committed training/evaluation split: disjoint, and the benchmark's rows are evaluation rows."""

from __future__ import annotations

import pytest

from dspark_export.datasets import DEFAULT_DATASETS, DEFAULT_SEED, default_datasets_dir, read_dataset, select_rows
from dspark_export.errors import ConfigError
from dspark_export.training.split import EVAL_ONLY, EVAL_ROWS_PER_DATASET, load_split, make_split, split_rows


def test_committed_split_parts_are_disjoint():
    split = load_split()
    for name, entry in split["datasets"].items():
        train, cal, ev = set(entry["train"]), set(entry["calibration"]), set(entry["eval"])
        assert not (train & ev) and not (cal & ev) and not (train & cal), name
        assert train | cal | ev == set(range(entry["rows"])), name
    for name in EVAL_ONLY:
        assert not split["datasets"][name]["train"] and not split["datasets"][name]["calibration"]
    assert len(split_rows(split, "train")) > 3000 and len(split_rows(split, "calibration")) > 100


@pytest.mark.skipif(default_datasets_dir() is None, reason="../shared/eval_datasets is not present")
def test_benchmark_rows_are_evaluation_rows_and_files_unchanged():
    folder = default_datasets_dir()
    split = load_split(datasets_dir=folder)  # raises if a prompt file changed
    for name in DEFAULT_DATASETS:
        texts = read_dataset(folder / f"{name}.jsonl")
        bench_rows = set(select_rows(texts, EVAL_ROWS_PER_DATASET, DEFAULT_SEED))
        assert bench_rows <= set(split["datasets"][name]["eval"]), name
    assert make_split(folder) == split  # the split is reproducible from its seed


def test_changed_prompt_file_is_detected(tmp_path):
    split = load_split()
    (tmp_path / "gsm8k.jsonl").write_text('{"turns": ["changed"]}\n')
    with pytest.raises(ConfigError, match="gsm8k.jsonl: sha256 differs"):
        load_split(datasets_dir=tmp_path)
