"""scripts/train_drafter.py end to end on a tiny target: data → features → train → calibrate → export."""

from __future__ import annotations

import json

import pytest

from dspark_export.datasets import default_datasets_dir
from dspark_export.modeling.checkpoint import read_drafter_config

from ..script_loader import load_script


def _script():
    return load_script("train_drafter.py")


@pytest.mark.skipif(default_datasets_dir() is None, reason="../shared/eval_datasets is not present")
def test_train_script_stages(tiny_target_dir, tmp_path):
    main = _script().main
    run = ["--run", str(tmp_path / "run"), "--target", str(tiny_target_dir)]
    assert main(["data", *run, "--limit", "3", "--calibration-limit", "3", "--max-new-tokens", "12",
                 "--batch", "2", "--sampled-fraction", "0.5"]) == 0
    lines = (tmp_path / "run" / "data" / "train.jsonl").read_text().splitlines()
    assert 1 <= len(lines) <= 3 and all(len(json.loads(x)["response_ids"]) <= 12 for x in lines)
    assert main(["features", *run, "--dtype", "float32", "--limit", "1"]) == 0  # a first slice of the data
    meta = json.loads((tmp_path / "run" / "features" / "train" / "meta.json").read_text())
    assert meta["complete"] and meta["num_records"] == 1
    assert main(["features", *run, "--dtype", "float32"]) == 0  # then the cache grows to all of it
    meta = json.loads((tmp_path / "run" / "features" / "train" / "meta.json").read_text())
    assert meta["complete"] and meta["num_records"] == len(lines)
    assert main(["train", *run, "--name", "d", "--steps", "2", "--seqs-per-step", "1", "--anchors-per-seq", "4",
                 "--markov-rank", "8"]) == 0
    # a warm start from that drafter at another block size
    assert main(["train", *run, "--name", "i", "--init-from", str(tmp_path / "run" / "d" / "drafter"), "--steps", "1",
                 "--seqs-per-step", "1", "--anchors-per-seq", "4", "--markov-rank", "8", "--block-size", "5"]) == 0
    assert read_drafter_config(tmp_path / "run" / "i" / "drafter").block_size == 5
    assert main(["train", *run, "--name", "j", "--init-from", str(tmp_path / "run" / "d" / "drafter"),
                 "--steps", "1", "--markov-rank", "4"]) == 2
    assert main(["calibrate", *run, "--name", "d", "--stride", "1"]) == 0
    summary = json.loads((tmp_path / "run" / "d" / "calibration" / "summary.json").read_text())
    assert summary["acceptance_length"] >= 1 and len(summary["sts"]["confidence_temperature"]) == 7
    assert (tmp_path / "run" / "d" / "calibration" / "reliability.png").is_file()
    assert main(["export", *run, "--name", "d", "--out", str(tmp_path / "shipped")]) == 0
    assert read_drafter_config(tmp_path / "shipped").is_trained
    assert (tmp_path / "shipped" / "calibration.json").is_file()
    # the draft vocabulary: ranking of the training responses, then an in-place recalibration with it
    assert main(["draft-vocab", *run, "--out", str(tmp_path / "shipped")]) == 0
    ranking = json.loads((tmp_path / "shipped" / "draft_vocab.json").read_text())
    assert ranking["records"] == len(lines) and ranking["ranking"][0] == 2  # EOS first
    assert main(["calibrate", *run, "--drafter", str(tmp_path / "shipped"), "--draft-vocab", "16",
                 "--calibration-out", str(tmp_path / "recal"), "--stride", "1"]) == 0
    recal = json.loads((tmp_path / "shipped" / "calibration.json").read_text())
    assert "draft vocabulary N = 16" in recal["fitted_on"] and (tmp_path / "recal" / "summary.json").is_file()
    assert main(["calibrate", *run, "--drafter", str(tmp_path / "shipped"), "--draft-vocab", "999"]) == 2
    # the DFlash ablation on the DSpark run's learning-rate path
    assert main(["train", *run, "--name", "f", "--variant", "dflash", "--steps", "2", "--seqs-per-step", "1",
                 "--anchors-per-seq", "4", "--lr-from", str(tmp_path / "run" / "d" / "metrics.jsonl")]) == 0
    lrs = [[json.loads(x)["lr"] for x in (tmp_path / "run" / name / "metrics.jsonl").read_text().splitlines()]
           for name in ("d", "f")]
    assert lrs[0] == lrs[1]
    # training over a draft vocabulary: d2t fixed beside the run and the checkpoint, τ per checkpoint logged
    assert main(["train", *run, "--name", "v", "--draft-vocab", "32", "--steps", "2", "--save-every", "1",
                 "--seqs-per-step", "1", "--anchors-per-seq", "4", "--markov-rank", "8", "--eval-stride", "2"]) == 0
    ranking = json.loads((tmp_path / "run" / "v" / "drafter" / "draft_vocab.json").read_text())
    assert ranking["records"] == len(lines)
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "v" / "checkpoints.jsonl").read_text().splitlines()] \
        == [1, 2]
    assert "bucket_mass" in json.loads((tmp_path / "run" / "v" / "metrics.jsonl").read_text().splitlines()[-1])
    assert main(["export", *run, "--name", "v", "--out", str(tmp_path / "shipped-v")]) == 0
    assert (tmp_path / "shipped-v" / "draft_vocab.json").is_file()
    assert main(["train", *run, "--name", "w", "--draft-vocab", "lots", "--steps", "1"]) == 2
    # domain-weighted sampling: a domain the records have, then a typo and a malformed weight
    from dspark_export.training.selfdata import record_domain

    domain = record_domain(json.loads(lines[0]))
    assert main(["train", *run, "--name", "dw", "--domain-weights", f"{domain}=3", "--steps", "1",
                 "--seqs-per-step", "1", "--anchors-per-seq", "4", "--markov-rank", "8"]) == 0
    assert main(["train", *run, "--name", "dx", "--domain-weights", "cdoe=3", "--steps", "1"]) == 2
    assert main(["train", *run, "--name", "dy", "--domain-weights", "code", "--steps", "1"]) == 2
    assert not (tmp_path / "run" / "dx").exists() and not (tmp_path / "run" / "dy").exists()   # refused up front
    # the objective's weights: saved with the run's config, so a resume with other weights is refused
    tiny = ["--steps", "1", "--seqs-per-step", "1", "--anchors-per-seq", "4", "--markov-rank", "8"]
    assert main(["train", *run, "--name", "lw", "--loss-weights", "ce=1,l1=0.5", *tiny]) == 0
    import torch

    saved = torch.load(tmp_path / "run" / "lw" / "training_state.pt", weights_only=True)["config"]["loss"]
    assert saved == {"ce": 1.0, "l1": 0.5, "bce": 1.0, "decay": 4.0}
    assert main(["train", *run, "--name", "lw", "--loss-weights", "ce=2", *tiny[:1], "2", *tiny[2:]]) == 2
    assert main(["train", *run, "--name", "lx", "--loss-weights", "ce=1,cee=2", *tiny]) == 2
    assert not (tmp_path / "run" / "lx").exists()
    # an interrupted run says so and leaves no drafter folder
    assert main(["train", *run, "--name", "e", "--steps", "50", "--seqs-per-step", "1", "--anchors-per-seq", "4",
                 "--markov-rank", "8", "--time-budget", "0"]) == 0
    assert not (tmp_path / "run" / "e" / "drafter").exists()


def test_train_draft_vocab_default_is_the_shipped_build_size():
    from dspark_export.pipeline import SHIPPED_DRAFTER_BUILD

    assert _script().DEFAULT_TRAIN_DRAFT_VOCAB == SHIPPED_DRAFTER_BUILD["draft_vocab"]


def test_shipped_build_flags_give_what_auto_gives_the_shipped_drafter():
    """The flags `export` prints for a candidate parse into the choices `build`'s auto makes for the shipped
    drafter: weights, draft vocabulary, layer format and LM head, each from SHIPPED_DRAFTER_BUILD."""
    from dspark_export.cli import _parser
    from dspark_export.pipeline import (SHIPPED_DRAFTER_BUILD, BuildConfig, resolve_drafter_lm_head, resolved_weights,
                                        shipped_build_flags)

    args = _parser().parse_args(["build", "--drafter", "cand", "--out", "eng", *shipped_build_flags().split()])
    assert args.weights == resolved_weights(BuildConfig(out="eng")) == SHIPPED_DRAFTER_BUILD["weights"]
    assert args.drafter_lm_head == resolve_drafter_lm_head("auto", {"kind": "checkpoint", "shipped": True})
    assert args.draft_vocab == str(SHIPPED_DRAFTER_BUILD["draft_vocab"])
    assert args.drafter_weights == SHIPPED_DRAFTER_BUILD["drafter_weights"]
    # without the flags the same folder builds as an imported checkpoint: exact drafting, fp32 target
    bare = _parser().parse_args(["build", "--drafter", "cand", "--out", "eng"])
    assert resolved_weights(BuildConfig(out="eng", drafter=bare.drafter)) == "fp32"
    assert resolve_drafter_lm_head(bare.drafter_lm_head, {"kind": "checkpoint", "shipped": False}) == "float32"


@pytest.mark.parametrize("text, message", [
    ("code=2,code=3", "repeated domain 'code'"), ("Code=2", "unknown domain 'Code'"),
    ("code=nan", "outside"), ("code=inf", "outside"), ("code=0", "outside"), ("code=1e308", "outside"),
    ("code=", "expected DOMAIN=WEIGHT"), ("=2", "expected DOMAIN=WEIGHT")])
def test_domain_weights_flag_is_checked_by_name(text, message):
    from dspark_export.errors import DsparkExportError

    with pytest.raises(DsparkExportError, match=f"--domain-weights: .*{message}"):
        _script()._domain_weights(text)
    assert _script()._domain_weights(" code = 2.5 ,chat=1") == {"code": 2.5, "chat": 1.0}


@pytest.mark.parametrize("text, message", [
    ("ce=1,ce=2", "at most once"), ("CE=1", "at most once, found 'CE=1'"), ("ce=", "TERM=WEIGHT"),
    ("ce=-1", "LossWeights.ce"), ("decay=0", "LossWeights.decay"), ("ce=0,l1=0", "both 0")])
def test_loss_weights_flag_is_checked_by_name(text, message):
    from dspark_export.errors import DsparkExportError

    with pytest.raises(DsparkExportError, match=f"--loss-weights.*{message}"):
        _script()._loss_weights(text)
    assert _script()._loss_weights(" ce = 1 ,l1=0.5").ce == 1.0
    assert _script()._loss_weights(None).ce == 0.1
