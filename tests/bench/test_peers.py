"""`dspark-export bench peers` on a tiny engine directory: every system runs for real on the tiny model
(onnxruntime-genai only where installed); missing peers are skipped with a reason."""

from __future__ import annotations

import importlib.util
import json

import pytest

from dspark_export.bench import peers
from dspark_export.bench.peers import PeersBenchConfig, run_peers_bench
from dspark_export.cli import main as cli_main
from dspark_export.errors import ConfigError, RequestError

BUCKETS = dict(target_buckets=(1, 2, 4, 8), request_buckets=(1, 2), max_context=64, profile_context=16,
               profile_repeats=2, block_size=4, markov_rank=8)
PROMPTS = ("hello there", "abc abc abc abc")
HAS_ORTGENAI = importlib.util.find_spec("onnxruntime_genai") is not None
HAS_LLAMACPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.fixture(scope="module")
def engine_dir(build_tiny_engine_dir):
    return build_tiny_engine_dir("peers", **BUCKETS)


def test_ours_and_transformers_on_the_same_prompts(engine_dir):
    cfg = PeersBenchConfig(engine_dir, prompts=PROMPTS, max_new_tokens=8,
                           systems=("ar", "dspark", "transformers", "transformers-pld"), policies=("fixed:2", "dspark"))
    result = run_peers_bench(cfg)
    rows = {r["system"]: r for r in result["results"]}
    assert list(rows) == ["dspark-export ar", "DSpark (best)", "dspark-export fixed:2", "dspark-export dspark",
                          "transformers", "transformers-pld"]
    assert rows["dspark-export ar"]["ratio_to_ar"] == 1.0
    for name, row in rows.items():
        assert row["tokens_per_s"] > 0 and len(row["per_prompt"]) == 2 and row["tokens"] > 0
        assert row["ratio_to_ar"] == pytest.approx(row["tokens_per_s"] / rows["dspark-export ar"]["tokens_per_s"],
                                                   rel=1e-2, abs=1e-3)  # the JSON rounds to 3 decimals
    # greedy speculative decoding is lossless: our policies reproduce ar token for token
    assert rows["dspark-export fixed:2"]["identical_to_ar"] is True and rows["dspark-export dspark"]["identical_to_ar"]
    best = max((rows["dspark-export fixed:2"], rows["dspark-export dspark"]), key=lambda r: r["tokens_per_s"])
    assert rows["DSpark (best)"]["policy"] == best["policy"] == result["best_dspark"]["policy"]
    assert rows["transformers-pld"]["prompt_lookup_num_tokens"] == 10
    assert isinstance(rows["transformers"]["identical_to_ar"], bool)
    for row in rows.values():  # our policies never diverge from ar; a peer's first divergence is a position or None
        if row.get("policy") not in (None, "ar"):
            assert row["prompts_identical_to_ar"] == len(row["per_prompt"])
            assert all(p["first_divergence"] is None for p in row["per_prompt"])
    assert set(result["dspark_speedup_over"]) == {"llama.cpp", "onnxruntime-genai", "onnxruntime-genai-int4",
                                                  "transformers", "transformers-pld"}
    assert result["dspark_speedup_over"]["onnxruntime-genai"] is None  # not run here


def test_missing_peer_is_skipped_with_a_reason(engine_dir, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime_genai" else real(name, *a))
    result = run_peers_bench(PeersBenchConfig(engine_dir, prompts=PROMPTS[:1], max_new_tokens=4,
                                              systems=("ar", "onnxruntime-genai")))
    row = result["results"][-1]
    assert row["system"] == "onnxruntime-genai" and "not installed" in row["skipped"]
    assert row["tokens_per_s"] is None and row["ratio_to_ar"] is None


def test_llamacpp_skipped_with_a_reason(engine_dir, monkeypatch):
    result = run_peers_bench(PeersBenchConfig(engine_dir, prompts=PROMPTS[:1], max_new_tokens=4,
                                              systems=("ar", "llama.cpp")))
    row = result["results"][-1]
    assert row["system"] == "llama.cpp" and row["tokens_per_s"] is None
    if HAS_LLAMACPP:  # the tiny engine directory comes from a transformers folder, not a GGUF
        assert "not built from a GGUF; pass --gguf" in row["skipped"]
    real = importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    result = run_peers_bench(PeersBenchConfig(engine_dir, prompts=PROMPTS[:1], max_new_tokens=4,
                                              systems=("ar", "llama.cpp")))
    assert "llama-cpp-python is not installed" in result["results"][-1]["skipped"]


@pytest.mark.skipif(not HAS_LLAMACPP, reason="llama-cpp-python not installed (optional extra 'llamacpp')")
def test_llamacpp_runs_the_gguf_the_engines_were_built_from(build_tiny_engine_dir, tmp_path_factory):
    """A tiny F32 GGUF: the engine directory is built from it, llama.cpp runs the file itself, greedy."""
    from tests.conftest import make_tiny_target
    from tests.modeling.conftest import write_tiny_llama_gguf

    gguf_path = write_tiny_llama_gguf(make_tiny_target("llama", seed=4), tmp_path_factory.mktemp("g") / "tiny.gguf")
    from dspark_export.pipeline import BuildConfig, build_engine_dir

    out = tmp_path_factory.mktemp("peers-gguf") / "tiny"
    build_engine_dir(BuildConfig(out=out, target=str(gguf_path), drafter="untrained", weights="fp32", **BUCKETS))
    result = run_peers_bench(PeersBenchConfig(out, prompts=PROMPTS, max_new_tokens=8, chat=False,
                                              systems=("ar", "llama.cpp"), threads=1))
    row = result["results"][-1]
    assert row["system"] == "llama.cpp" and row.get("skipped") is None, row
    assert row["model"] == str(gguf_path) and row["precision"] == "ALL_F32" and row["threads"] == 1
    assert row["tokens"] > 0 and row["tokens_per_s"] > 0 and len(row["per_prompt"]) == 2
    assert row["identical_to_ar"] is True  # the same F32 weights, greedy


def test_default_prompts_per_dataset(engine_dir, tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [f"{name}{i}"]}) + "\n" for i in range(4)))
    cfg = PeersBenchConfig(engine_dir, datasets=("a", "b"), datasets_dir=tmp_path, prompts_per_dataset=3)
    assert cfg.prompts == ("a0", "a1", "a2", "b0", "b1", "b2")
    with pytest.raises(ConfigError, match="prompts_per_dataset"):
        PeersBenchConfig(engine_dir, prompts=("x",), prompts_per_dataset=0)
    with pytest.raises(ConfigError, match="threads"):
        PeersBenchConfig(engine_dir, prompts=("x",), threads=0)


def test_transformers_skipped_without_a_transformers_folder(engine_dir, tmp_path):
    result = run_peers_bench(PeersBenchConfig(engine_dir, prompts=PROMPTS[:1], max_new_tokens=4,
                                              systems=("transformers",), hf_model=tmp_path))
    assert result["results"][0]["system"] == "dspark-export ar"  # ar is always run: it is the baseline
    assert "no transformers folder" in result["results"][1]["skipped"]


@pytest.mark.skipif(not HAS_ORTGENAI, reason="onnxruntime-genai not installed (in the test extra: pip install -e '.[test]')")
def test_onnxruntime_genai_built_from_the_same_folder(engine_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("DSPARK_EXPORT_CACHE", str(tmp_path / "cache"))
    result = run_peers_bench(PeersBenchConfig(engine_dir, prompts=PROMPTS, max_new_tokens=8,
                                              systems=("ar", "onnxruntime-genai")))
    row = result["results"][-1]
    assert row["system"] == "onnxruntime-genai" and row.get("skipped") is None, row
    assert row["tokens_per_s"] > 0 and row["model"].startswith(str(tmp_path / "cache"))
    assert (tmp_path / "cache" / "ortgenai").is_dir()


def test_cli_json_and_errors(engine_dir, tmp_path, capsys):
    out = tmp_path / "peers.json"
    code = cli_main(["bench", "peers", "--engine-dir", str(engine_dir), "--prompt", "hi", "--max-new-tokens", "4",
                     "--systems", "ar,dspark", "--policies", "fixed:1", "--json", str(out), "--out-dir",
                     str(tmp_path / "r")])
    assert code == 0
    data = json.loads(out.read_text())
    assert all({"system", "tokens_per_s", "ratio_to_ar"} <= set(r) for r in data["results"])
    assert {p.name for p in (tmp_path / "r").iterdir()} == {"peers.json", "peers.md", "peers.png"}
    assert "| dspark-export ar |" in capsys.readouterr().out
    code = cli_main(["bench", "peers", "--engine-dir", str(engine_dir), "--prompt", "hi", "--systems", "vllm"])
    err = capsys.readouterr().err
    assert code == 2 and "systems" in err and "Traceback" not in err
    with pytest.raises(ConfigError, match="baseline"):
        PeersBenchConfig(engine_dir, prompts=("x",), policies=("ar",))


def test_first_divergence():
    from dspark_export.bench.peers import first_divergence

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2 and first_divergence([1, 2, 3], [1, 2]) == 2


def test_repeats_interleave_rounds_and_report_per_round_ratios(engine_dir, monkeypatch):
    """--repeats 3: every system runs every prompt three times, systems in reverse order on the middle round;
    a prompt's time is its median over rounds, and each row carries its ratio to ar round by round."""
    order = []
    real = peers._ours

    def spy(rt, policy):
        fn = real(rt, policy)
        return lambda ids, n: (order.append(policy), fn(ids, n))[1]

    monkeypatch.setattr(peers, "_ours", spy)
    cfg = PeersBenchConfig(engine_dir, prompts=PROMPTS, max_new_tokens=6, systems=("ar", "dspark"),
                           policies=("fixed:2",), repeats=3, warmup=False)
    result = run_peers_bench(cfg)
    assert order == ["ar", "fixed:2"] * 2 + ["fixed:2", "ar"] * 2 + ["ar", "fixed:2"] * 2
    rows = {r["system"]: r for r in result["results"]}
    spec = rows["dspark-export fixed:2"]
    assert len(spec["round_ratios_to_ar"]) == 3 and all(r > 0 for r in spec["round_ratios_to_ar"])
    assert "round_ratios_to_ar" not in rows["dspark-export ar"]
    assert spec["identical_to_ar"] is True and result["config"]["repeats"] == 3
    assert "per round ×ar" in peers.markdown_table(result)


def test_repeats_out_of_range_is_named(engine_dir):
    with pytest.raises(ConfigError, match="repeats: expected an integer in \\[1, 100\\], found 0"):
        PeersBenchConfig(engine_dir, prompts=PROMPTS, repeats=0)


def test_repeats_refuse_ours_generating_other_tokens_in_a_later_round(engine_dir, monkeypatch):
    real, calls = peers._ours, {"n": 0}

    def drifting(rt, policy):
        fn = real(rt, policy)
        if policy == "ar":
            return fn

        def gen(ids, n):
            calls["n"] += 1
            out = list(fn(ids, n))
            return out if calls["n"] <= len(PROMPTS) else out[:-1]   # round 2 drops a token

        return gen

    monkeypatch.setattr(peers, "_ours", drifting)
    cfg = PeersBenchConfig(engine_dir, prompts=PROMPTS, max_new_tokens=6, systems=("ar", "dspark"),
                           policies=("fixed:2",), repeats=2, warmup=False)
    with pytest.raises(RequestError, match="dspark-export fixed:2: round 2 generated other tokens than round 1 "
                                           "for prompt 0"):
        run_peers_bench(cfg)
