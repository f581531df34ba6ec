"""End to end on a tiny random Llama: build an engine directory, then generate through it."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dspark_export.cli import main as cli_main
from dspark_export.engines.manifest import Manifest
from dspark_export.errors import BuildError, EngineDirError
from dspark_export.pipeline import BuildConfig, build_engine_dir
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.generator import Generator
from dspark_export.runtime.policies import parse_policy
from dspark_export.runtime.request import SamplingParams
from dspark_export.runtime.stages import ContextWindow, EngineStages

from tests.conftest import TINY_BUILD as BUCKETS


@pytest.fixture(scope="module")
def engine_dir(tiny_engine_dir):
    return tiny_engine_dir


@pytest.fixture(scope="module")
def runtime(engine_dir):
    return Runtime.open(engine_dir, policy="ar")


PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41], [100] * 11, [7, 3, 9, 200, 17, 18, 19, 20, 21]]


def _run(rt, policy, prompts=PROMPTS, **kw):
    rt.set_policy(policy)
    params = [SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 24), **kw) for _ in prompts]
    return rt.generate_ids(prompts, params)


def test_engine_directory_contents(engine_dir):
    m = Manifest.load(engine_dir)
    assert set(m.data["graphs"]) == {"target", "drafter_context", "drafter_block", "verify"}
    assert {k.bucket for k in m.engine_keys("target")} == set(BUCKETS["target_buckets"])
    sps = json.loads((engine_dir / "profile" / "sps.json").read_text())
    assert [row["B"] for row in sps["target"]] == list(BUCKETS["target_buckets"])
    assert all(row["p10_ms"] <= row["median_ms"] <= row["p90_ms"] for row in sps["target"])
    assert m.runtime["drafter_trained"] is False
    assert not list(engine_dir.parent.glob(".tiny.partial-*"))


@pytest.mark.parametrize("policy", ["fixed:4", "fixed:1", "threshold:0.4", "dspark", "dspark-async"])
def test_greedy_output_equals_ar_under_every_policy(runtime, policy):
    ar = _run(runtime, "ar")
    for a, s in zip(ar, _run(runtime, policy)):
        assert s.token_ids == a.token_ids


def test_greedy_fixed_equals_ar_and_batch_equals_solo(runtime):
    ar = _run(runtime, "ar")
    spec = _run(runtime, "fixed:4")
    for a, s in zip(ar, spec):
        assert a.finish_reason in ("length", "stop") and a.token_ids == s.token_ids
        assert s.stats.rounds == len(s.token_ids) - 1 - s.stats.accepted_tokens or s.finish_reason == "stop"
    assert sum(len(r.token_ids) for r in ar) > 40
    solo = [_run(runtime, "fixed:3", [p])[0] for p in PROMPTS]
    assert [r.token_ids for r in solo] == [r.token_ids for r in ar]
    assert all(len(r.token_ids) == 24 or r.finish_reason == "stop" for r in ar)


def test_oracle_drafts_exercise_acceptance(runtime, monkeypatch):
    """Drafts that copy the AR continuation for a varying prefix: none, some and all accepted,
    and the output stays identical to AR (target KV and drafter context commit exactly a+1 rows)."""
    ar = {tuple(p): r.token_ids for p, r in zip(PROMPTS, _run(runtime, "ar", max_new_tokens=30))}
    # dspark and dspark-async price drafts with the build's profile, timed on whatever else the machine runs
    # (a loaded one can price every draft out); here verifying and drafting are free, so both verify
    from dspark_export.engines.sps import ThroughputProfile

    buckets = tuple(BUCKETS["target_buckets"])
    monkeypatch.setattr("dspark_export.runtime.generator._load_profile", lambda engines: ThroughputProfile(
        buckets, (100.0,) * len(buckets), draft_requests=(1,), draft_ms=(0.0,)))
    original = EngineStages.draft
    calls = {"n": 0}

    def oracle(self, active, flushed, every=True):
        out = original(self, active, flushed, every)
        ids = out["draft_ids"].copy()
        for s in active:
            future = ar[tuple(s.prompt.tolist())][len(s.result.token_ids):]
            good = calls["n"] % (self.block_size + 1)  # 0..γ correct drafts, then a wrong one
            for k in range(self.block_size):
                if k < good and k < len(future):
                    ids[s.slot, k] = future[k]
                elif k < len(future):
                    ids[s.slot, k] = (future[k] + 1) % self.vocab_size
            calls["n"] += 1
        logits = np.full(out["draft_logits"].shape, -30.0, np.float32)
        np.put_along_axis(logits, ids[..., None], 30.0, axis=-1)
        return {**out, "draft_ids": ids, "draft_logits": logits}

    monkeypatch.setattr(EngineStages, "draft", oracle)
    for policy in ("fixed:4", "dspark", "dspark-async"):
        spec = _run(runtime, policy, max_new_tokens=30)
        for p, r in zip(PROMPTS, spec):
            assert r.token_ids == ar[tuple(p)], policy
        assert sum(r.stats.accepted_tokens for r in spec) > 0
    spec = _run(runtime, "fixed:4", max_new_tokens=30)
    assert max(r.stats.acceptance_length for r in spec) > 1.5


def test_seeded_sampling_is_reproducible(runtime):
    a = _run(runtime, "fixed:4", temperature=0.9, seed=7)
    b = _run(runtime, "fixed:4", temperature=0.9, seed=7)
    c = _run(runtime, "fixed:4", temperature=0.9, seed=8)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


def test_bad_request_fails_alone(runtime):
    prompts = [[5, 6, 7], [1] * 200, [], [9, 9, 300]]
    res = _run(runtime, "fixed:4", prompts)
    assert res[0].finish_reason == "length" and len(res[0].token_ids) == 24
    assert res[1].finish_reason == "error" and "capacity 96" in res[1].error
    assert res[2].finish_reason == "error" and "empty prompt" in res[2].error
    assert res[3].finish_reason == "error" and "[0, 256)" in res[3].error


def test_generation_stops_at_capacity(runtime):
    [r] = _run(runtime, "fixed:4", [[5] * 80], max_new_tokens=50)
    assert r.finish_reason in ("capacity", "stop")
    assert r.finish_reason == "stop" or 80 + len(r.token_ids) == 96 + 1


def test_altered_engine_file_is_refused(engine_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(engine_dir, copy)
    spec = next((copy / "engines" / "onnxruntime").glob("target.N8.json"))
    altered = spec.read_text().replace('"ORT_ENABLE_ALL"', '"ORT_ENABLE_BASIC"')
    assert altered != spec.read_text()
    spec.write_text(altered)
    with pytest.raises(EngineDirError, match="target.N8.json"):
        Runtime.open(copy)


def test_failed_build_leaves_nothing(tiny_target_dir, tmp_path, monkeypatch):
    import dspark_export.pipeline as pipeline

    def boom(*a, **k):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pipeline, "measure_profile", boom)
    out = tmp_path / "eng"
    with pytest.raises(RuntimeError, match="interrupted"):
        build_engine_dir(BuildConfig(out=out, target=str(tiny_target_dir), drafter="untrained", **BUCKETS))
    assert not out.exists() and list(tmp_path.iterdir()) == []
    out.mkdir()
    with pytest.raises(BuildError, match="already exists"):
        build_engine_dir(BuildConfig(out=out, target=str(tiny_target_dir), **BUCKETS))


def test_cli_generate_json(engine_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'\xef\xbb\xbf{"prompt": "hi 2+3?"}\nnot json\n{"prompt": "x' + b"y" * 300
                        + b'"}\n{"prompt": "ok"}\n{"prompt": "caf\xe9\xff"}\n')
    rc = cli_main(["generate", "--engine-dir", str(engine_dir), "--prompts-file", str(prompts), "--chat",
                   "--json", "--max-new-tokens", "8", "--policy", "fixed:4"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rc == 1 and len(rows) == 5
    assert [r["finish_reason"] for r in rows][1:3] == ["error", "error"] and rows[4]["finish_reason"] == "error"
    assert "p.jsonl:2" in rows[1]["error"] and "capacity" in rows[2]["error"]
    assert "p.jsonl:5: not valid UTF-8" in rows[4]["error"]
    for r in (rows[0], rows[3]):
        assert len(r["token_ids"]) == 8 or r["finish_reason"] == "stop"
        assert {"prompt_tokens", "completion_tokens", "rounds", "acceptance_length", "wall_s",
                "tokens_per_s"} <= set(r["stats"])


def test_cli_errors_are_one_line(tmp_path, capsys):
    rc = cli_main(["generate", "--engine-dir", str(tmp_path / "missing"), "--prompt", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and "no such directory" in err[-1] and "Traceback" not in "\n".join(err)
    rc = cli_main(["build", "--target", str(tmp_path), "--out", str(tmp_path / "o")])
    assert rc == 2 and "config.json" in capsys.readouterr().err


@pytest.mark.parametrize("edit,match", [
    ({"hidden_size": 32}, r"hidden_size.*32.*64|hidden_size.*64.*32"),
    ({"vocab_size": 128, "mask_token_id": 5}, r"vocab_size.*128.*256|vocab_size.*256.*128"),
    ({"target_layer_ids": [1, 3]}, r"target_layer_ids"),
], ids=["hidden", "vocab", "taps"])
def test_drafter_that_does_not_fit_the_target(tiny_target_dir, tmp_path, edit, match):
    from dspark_export.errors import ConfigError
    from dspark_export.modeling.checkpoint import save_drafter
    from dspark_export.modeling.config import DrafterConfig
    from dspark_export.modeling.drafter import init_drafter
    from dspark_export.modeling.target import load_target

    target = load_target(tiny_target_dir)
    drafter = init_drafter(target, DrafterConfig.from_target(target.config, block_size=4, markov_rank=8))
    ckpt = save_drafter(drafter, tmp_path / "drafter")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(edit)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "eng"
    with pytest.raises(ConfigError, match=match):
        build_engine_dir(BuildConfig(out=out, target=str(tiny_target_dir), drafter=str(ckpt), **BUCKETS))
    assert not out.exists()


def test_overwrite_replaces_only_engine_directories(engine_dir, tiny_target_dir, tmp_path, monkeypatch):
    user = tmp_path / "userdir"
    user.mkdir()
    (user / "important.txt").write_text("keep me")
    cfg = dict(target=str(tiny_target_dir), drafter="untrained", overwrite=True, **BUCKETS)
    with pytest.raises(BuildError, match="not an engine directory"):
        build_engine_dir(BuildConfig(out=user, **cfg))
    assert (user / "important.txt").read_text() == "keep me"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(BuildError, match="not a directory"):
        build_engine_dir(BuildConfig(out=tmp_path / "afile", **cfg))
    monkeypatch.chdir(user)
    for bad in (".", "..", str(tmp_path)):
        with pytest.raises(BuildError, match="refusing"):
            build_engine_dir(BuildConfig(out=bad, **cfg))
    assert (user / "important.txt").exists() and [p.name for p in tmp_path.iterdir()] == ["userdir", "afile"]


def test_profile_reseals_the_manifest(engine_dir, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(engine_dir, copy)
    assert cli_main(["profile", "--engine-dir", str(copy), "--context", "8", "--repeats", "1"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    fit = json.loads((copy / "profile" / "sps.json").read_text())["attention"]
    assert printed["layout_cost"] == {k: fit[k] for k in ("ms_per_row_entry", "ms_per_slot_entry", "max_error_pct")}
    m = Manifest.load(copy)
    assert m.data["profile"]["context_len"] == 8
    assert json.loads((copy / "profile" / "sps.json").read_text())["context_len"] == 8
    assert oct((copy / "manifest.json").stat().st_mode)[-3:] == "644"
    assert cli_main(["profile", "--engine-dir", str(copy), "--context", "500"]) == 2


def test_fixed_k_beyond_the_block_size_is_refused(engine_dir):
    from dspark_export.errors import RequestError
    with pytest.raises(RequestError, match="exceeds this engine directory's block size 4"):
        Runtime.open(engine_dir, policy="fixed:9")


def test_bucket_choice_prefers_a_faster_larger_engine(engine_dir):
    from dspark_export.engines.engine_set import EngineSet
    from dspark_export.engines.sps import ThroughputProfile

    engines = EngineSet.open(engine_dir, verify=False)
    engines._latency_ms["target"] = {1: 5.0, 2: 9.0, 4: 7.0, 8: 12.0, 16: 20.0, 32: 40.0, 64: 80.0}
    assert [engines.bucket_for("target", n) for n in (1, 2, 3, 4, 5)] == [1, 4, 4, 4, 8]
    assert engines.runner_exact("target", 2).key.bucket == 2
    profile = ThroughputProfile((1, 2, 4, 8), (200.0, 111.0, 142.0, 83.0))
    assert [round(float(profile.sps(b))) for b in (1, 2, 3, 4, 8, 9)] == [200, 142, 142, 142, 83, 0]


def test_build_settings_are_checked_before_work(tiny_target_dir, tmp_path):
    from dspark_export.errors import ConfigError

    base = {**BUCKETS, "target": str(tiny_target_dir), "drafter": "untrained"}
    with pytest.raises(ConfigError, match="max_position_embeddings 512, found 1024"):
        build_engine_dir(BuildConfig(out=tmp_path / "a", **{**base, "max_context": 1024}))
    with pytest.raises(ConfigError, match="profile_context"):
        BuildConfig(out=tmp_path / "b", **{**base, "profile_context": 500})
    with pytest.raises(ConfigError, match="profile_repeats"):
        BuildConfig(out=tmp_path / "c", **{**base, "profile_repeats": 0})
    assert not any(tmp_path.iterdir())


def test_build_sweeps_partials_of_dead_processes(tiny_target_dir, tmp_path):
    dead = tmp_path / ".eng.partial-999999999-abc"
    alive = tmp_path / f".eng.partial-{__import__('os').getpid()}-xyz"
    for d in (dead, alive):
        d.mkdir()
        (d / "graphs").mkdir()
    build_engine_dir(BuildConfig(out=tmp_path / "eng", target=str(tiny_target_dir), drafter="untrained", **BUCKETS))
    assert not dead.exists() and alive.exists()
    assert Manifest.load(tmp_path / "eng").runtime["block_size"] == 4


def test_calibration_next_to_the_drafter_reaches_the_manifest(tiny_target_dir, tmp_path):
    """An fp16, embedding-free drafter folder (the shipped layout) with STS temperatures builds, and
    the runtime reads the temperatures; a malformed calibration file is refused before any work."""
    import torch

    from dspark_export.errors import ConfigError
    from dspark_export.modeling.checkpoint import save_drafter
    from dspark_export.modeling.config import DrafterConfig
    from dspark_export.modeling.drafter import init_drafter
    from dspark_export.modeling.target import load_target

    target = load_target(tiny_target_dir)
    drafter = init_drafter(target, DrafterConfig.from_target(target.config, block_size=4, markov_rank=8))
    ckpt = save_drafter(drafter, tmp_path / "drafter", include_embeddings=False, dtype=torch.float16)
    temps = [0.8, 1.1, 1.3, 2.0]
    (ckpt / "calibration.json").write_text(json.dumps({"method": "sts", "confidence_temperature": temps}))
    out = tmp_path / "eng"
    build_engine_dir(BuildConfig(out=out, target=str(tiny_target_dir), drafter=str(ckpt), **BUCKETS))
    assert Manifest.load(out).runtime["confidence_temperature"] == temps
    gen = Generator(Runtime.open(out, policy="dspark").engines, parse_policy("dspark"))
    assert gen.stages.sts.tolist() == pytest.approx(temps)
    (ckpt / "calibration.json").write_text(json.dumps({"confidence_temperature": [1.0, -1.0, 1.0, 1.0]}))
    with pytest.raises(ConfigError, match=r"calibration.json: confidence_temperature: expected 4 finite positive"):
        build_engine_dir(BuildConfig(out=tmp_path / "eng2", target=str(tiny_target_dir), drafter=str(ckpt), **BUCKETS))
    assert not (tmp_path / "eng2").exists()


def test_imported_drafter_with_embedding_tap_drafts_exactly_by_default(tiny_target_dir, tmp_path):
    """A drafter checkpoint brought by the user (here with DeepSpec's tap -1, the embedding output) builds with
    `--drafter-lm-head auto` into the float32 head, so it drafts as its source; the manifest and `inspect`
    say so; greedy speculative output equals `ar`. An int8 head on an import is the user's explicit opt-in and
    is named as an approximation."""
    from dspark_export.engines.inspect import inspect_engine_dir
    from dspark_export.modeling.checkpoint import save_drafter
    from dspark_export.modeling.config import DrafterConfig
    from dspark_export.modeling.drafter import init_drafter
    from dspark_export.modeling.target import load_target

    target = load_target(tiny_target_dir)
    cfg = DrafterConfig.from_target(target.config, block_size=4, markov_rank=8, target_layer_ids=(-1, 1))
    ckpt = save_drafter(init_drafter(target, cfg, seed=1), tmp_path / "drafter")
    out = tmp_path / "eng"
    build_engine_dir(BuildConfig(out=out, target=str(tiny_target_dir), drafter=str(ckpt), **BUCKETS))
    m = Manifest.load(out)
    assert m.data["graphs"]["drafter_block"]["spec"]["lm_head_dtype"] == "float32"
    assert m.data["graphs"]["target"]["spec"]["tap_layer_ids"] == [-1, 1]
    assert m.data["source"]["drafter"]["approximations"] == [] and m.data["source"]["drafter"]["shipped"] is False
    assert "drafting exact" in inspect_engine_dir(out).format_text()
    rt = Runtime.open(out, policy="ar")
    ar = _run(rt, "ar")
    for a, s in zip(ar, _run(rt, "fixed:4")):
        assert s.token_ids == a.token_ids
    opt_in = tmp_path / "eng-int8"
    build_engine_dir(BuildConfig(out=opt_in, target=str(tiny_target_dir), drafter=str(ckpt), drafter_lm_head="int8",
                                 drafter_context="4,32", **BUCKETS))
    m = Manifest.load(opt_in)
    approx = m.data["source"]["drafter"]["approximations"]
    assert [(a["name"], a["value"]) for a in approx] == [("drafter_lm_head", "int8"), ("drafter_context", "4,32")]
    assert "approximation drafter_lm_head=int8" in inspect_engine_dir(opt_in).format_text()
    assert "drafter_context_window" not in Manifest.load(out).runtime
    assert m.runtime["drafter_context_window"] == {"sink": 4, "recent": 32}
    assert Runtime.open(opt_in, policy="fixed:4").generator.stages.context_window == ContextWindow(4, 32)
