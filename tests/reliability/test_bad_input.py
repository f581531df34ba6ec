"""Bad input (issue 7, item 2): files, parameters and prompts. Each case asserts an error that names
the problem (file / field, expected vs found) and that nothing is lost: no half-written output
directory, other requests in the same batch unaffected (their output equals their solo run).
Cases covered by earlier test modules are listed in tests/reliability/README.md."""

from __future__ import annotations

import json
import math
import shutil

import pytest

from dspark_export.cli import main as cli_main
from dspark_export.errors import CheckpointError, ConfigError, EngineDirError, RequestError
from dspark_export.pipeline import BuildConfig, build_engine_dir
from dspark_export.runtime.api import Runtime
from dspark_export.runtime.request import MAX_NEW_TOKENS_LIMIT, SamplingParams

from .conftest import REL_BUILD, ar_tokens, generator, run_steps

GOOD = [[5, 6, 7, 8], [40, 41, 42]]


# -- files: engine directory -----------------------------------------------------------------
@pytest.fixture()
def copy_dir(rel_engine_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(rel_engine_dir, dst)
    return dst


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _flip(path, at=0.5):
    data = bytearray(path.read_bytes())
    i = int(len(data) * at)
    data[i:i + 16] = bytes(b ^ 0xFF for b in data[i:i + 16])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, file, verified, unverified", [
    (_truncate, "graphs/target.onnx", r"graphs/target.onnx.*expected \d+ bytes", r"graphs/target.onnx.*expected \d+ bytes"),
    (_flip, "graphs/target.onnx", r"graphs/target.onnx.*altered: sha256", r"target.onnx"),
    (_truncate, "graphs/target.onnx.data", r"target.onnx.data.*expected \d+ bytes", r"target.onnx.data.*expected \d+ bytes"),
    (lambda p: p.write_bytes(b"\x00" * 64), "graphs/verify.onnx", r"verify.onnx.*expected \d+ bytes", r"verify.onnx"),
], ids=["truncated-onnx", "corrupted-onnx", "truncated-weights", "zeroed-onnx"])
def test_damaged_engine_files(copy_dir, damage, file, verified, unverified):
    """A truncated or corrupted ONNX graph or weight file: with the integrity check (default) the
    manifest names the file and the size/hash mismatch; with --no-verify (sizes still checked, no
    hashes) a truncated file is caught by its size and a same-size corruption when ONNX / ONNX
    Runtime reads it, the message naming the file."""
    damage(copy_dir / file)
    with pytest.raises(EngineDirError, match=verified):
        Runtime.open(copy_dir)
    with pytest.raises(EngineDirError, match=unverified):
        Runtime.open(copy_dir, verify=False)


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.update(schema_version=3), r"schema_version: expected one of \[1, 2\], found 3"),
    (lambda d: d.pop("files"), r"missing fields \['files'\]"),
    (lambda d: d["runtime"].pop("max_context"), r"runtime.max_context"),
    (lambda d: d["files"]["graphs/target.onnx"].update(sha256="0" * 64), r"graphs/target.onnx.*altered: sha256"),
    (lambda d: d["graphs"]["target"].update(path="../../../etc/passwd"), r"points outside the engine directory"),
    (lambda d: d["graphs"]["target"].update(path="/etc/passwd"), r"expected a relative path"),
], ids=["unknown-schema", "missing-files", "missing-runtime-field", "altered-hash", "path-escape", "absolute-path"])
def test_bad_manifest(copy_dir, edit, match):
    data = json.loads((copy_dir / "manifest.json").read_text())
    edit(data)
    (copy_dir / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EngineDirError, match=match):
        Runtime.open(copy_dir)


def test_manifest_that_is_not_json(copy_dir):
    (copy_dir / "manifest.json").write_bytes(b'{"schema_version": 1, "graphs": {\xff')
    with pytest.raises(EngineDirError, match=r"manifest.json: not valid JSON"):
        Runtime.open(copy_dir)


# -- files: build inputs (nothing may be left at --out) ------------------------------------------
@pytest.fixture()
def target_copy(tiny_target_dir, tmp_path):
    dst = tmp_path / "target"
    shutil.copytree(tiny_target_dir, dst)
    return dst


def _build(tmp_path, target, drafter="untrained"):
    out = tmp_path / "out"
    try:
        build_engine_dir(BuildConfig(out=out, target=str(target), drafter=drafter, **REL_BUILD))
    finally:
        assert not out.exists() or (out / "manifest.json").exists()
    return out


def _leftovers(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out") or p.name == "out")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_build_from_a_damaged_safetensors_target(target_copy, tmp_path, damage):
    path = target_copy / "model.safetensors"
    _truncate(path, 0.3) if damage == "truncate" else path.write_bytes(b"not a safetensors file at all" * 10)
    with pytest.raises(CheckpointError, match=r"model.safetensors: unreadable safetensors file"):
        _build(tmp_path, target_copy)
    assert _leftovers(tmp_path) == []


def _drafter_ckpt(tiny_target_dir, tmp_path):
    from dspark_export.modeling.checkpoint import save_drafter
    from dspark_export.modeling.config import DrafterConfig
    from dspark_export.modeling.drafter import init_drafter
    from dspark_export.modeling.target import load_target

    target = load_target(tiny_target_dir)
    drafter = init_drafter(target, DrafterConfig.from_target(target.config, block_size=8, markov_rank=8))
    return save_drafter(drafter, tmp_path / "drafter")


@pytest.mark.parametrize("change, match", [
    ("truncate", r"model.safetensors"),
    ("int-dtype", r"(?i)dtype|float"),
    ("wrong-shape", r"shape"),
    ("missing-tensor", r"(?i)missing"),
], ids=["truncated", "int-dtype", "wrong-shape", "missing-tensor"])
def test_build_with_a_bad_deepspec_checkpoint(tiny_target_dir, tmp_path, change, match):
    """A DeepSpec drafter checkpoint that is truncated, holds an integer tensor, a tensor of the wrong
    shape, or lacks a tensor: CheckpointError naming the tensor/file; no output directory."""
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = _drafter_ckpt(tiny_target_dir, tmp_path)
    weights = next(ckpt.glob("*.safetensors"))
    if change == "truncate":
        _truncate(weights, 0.4)
    else:
        sd = load_file(weights)
        name = next(k for k in sd if k.endswith("fc.weight") or "q_proj.weight" in k)
        if change == "int-dtype":
            sd[name] = sd[name].to(torch.int32)
        elif change == "wrong-shape":
            sd[name] = sd[name][:, :-1].contiguous()
        else:
            del sd[name]
        save_file(sd, weights)
    with pytest.raises((CheckpointError, ConfigError), match=match):
        _build(tmp_path, tiny_target_dir, drafter=str(ckpt))
    assert _leftovers(tmp_path) == []


def test_build_from_a_truncated_gguf(tiny_target_dir, tmp_path):
    """A .gguf target cut short: CheckpointError naming the file; no output directory."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 20)
    with pytest.raises(CheckpointError, match=r"model.gguf"):
        _build(tmp_path, gguf)
    assert _leftovers(tmp_path) == []


# -- parameters and prompts: each bad request fails alone --------------------------------------
BAD_REQUESTS = {
    "negative-temperature": ([7, 8], dict(temperature=-0.5), r"temperature: expected a finite value >= 0, found -0.5"),
    "nan-temperature": ([7, 8], dict(temperature=math.nan), r"temperature: .* found nan"),
    "string-temperature": ([7, 8], dict(temperature="hot"), r"temperature: .* found 'hot'"),
    "top-p-zero": ([7, 8], dict(top_p=0.0), r"top_p: expected a value in \(0, 1\], found 0.0"),
    "top-p-above-one": ([7, 8], dict(top_p=1.5), r"top_p: .* found 1.5"),
    "top-p-nan": ([7, 8], dict(top_p=math.nan), r"top_p: .* found nan"),
    "negative-top-k": ([7, 8], dict(top_k=-1), r"top_k: expected an integer >= 0"),
    "max-new-tokens-zero": ([7, 8], dict(max_new_tokens=0), r"max_new_tokens: expected an integer in \[1, "),
    "max-new-tokens-huge": ([7, 8], dict(max_new_tokens=1 << 40), r"max_new_tokens: .* found 1099511627776"),
    "max-new-tokens-float": ([7, 8], dict(max_new_tokens=8.5), r"max_new_tokens: .* found 8.5"),
    "negative-seed": ([7, 8], dict(seed=-3), r"seed: expected an integer >= 0"),
    "empty-stop-string": ([7, 8], dict(stop=("",)), r"stop: expected a tuple of non-empty strings"),
    "stop-not-a-tuple": ([7, 8], dict(stop="</s>"), r"stop: expected a tuple"),
    "bad-stop-id": ([7, 8], dict(stop_token_ids=(-1,)), r"stop_token_ids: expected a tuple of token ids"),
    "empty-prompt": ([], {}, r"prompt: expected at least one token, found an empty prompt"),
    "prompt-over-capacity": ([5] * 600, {}, r"prompt: 600 tokens exceed the engine's context capacity 512"),
    "prompt-fills-capacity": ([5] * 512, {}, r"prompt: 512 tokens exceed .* capacity 512"),
    "out-of-vocab-id": ([5, 256, -1], {}, r"prompt: token ids must be in \[0, 256\), found \[256, -1\]"),
    "text-instead-of-ids": ("hello", {}, r"prompt: expected a list of token ids .*Runtime.encode"),
    "float-ids": ([5.0, 6.5], {}, r"prompt: expected a list of token ids"),
    "none-prompt": (None, {}, r"prompt: expected a list of token ids"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_fails_alone(rel_runtime, case):
    prompt, params, match = BAD_REQUESTS[case]
    rt = rel_runtime
    for policy in ("fixed:4", "ar"):
        gen = generator(rt, policy, max_slots=2)
        a = gen.submit(GOOD[0], SamplingParams(max_new_tokens=12))
        bad = gen.submit(prompt, SamplingParams(**{"max_new_tokens": 12, **params}))
        b = gen.submit(GOOD[1], SamplingParams(max_new_tokens=12))
        r = gen.result(bad)
        assert r.finish_reason == "error" and r.token_ids == []
        import re
        assert re.search(match, r.error), (r.error, match)
        run_steps(gen)
        assert gen.result(a).token_ids == ar_tokens(rt, GOOD[0], 12)
        assert gen.result(b).token_ids == ar_tokens(rt, GOOD[1], 12)
        assert gen.release(bad).error == r.error


def test_huge_but_allowed_max_new_tokens_ends_at_capacity(rel_runtime):
    gen = generator(rt := rel_runtime, "fixed:8")
    rid = gen.submit([5] * 480, SamplingParams(max_new_tokens=MAX_NEW_TOKENS_LIMIT, stop_token_ids=()))
    run_steps(gen)
    r = gen.result(rid)
    assert r.finish_reason in ("capacity", "stop")
    assert r.finish_reason == "stop" or 480 + len(r.token_ids) == 512 + 1
    del rt


@pytest.mark.parametrize("policy, match", [("turbo", r"policy: expected one of 'ar', 'fixed:K'"),
                                           ("fixed:0", r"'fixed:K' needs an integer K >= 1"),
                                           ("fixed:99", r"K=99 exceeds this engine directory's block size 8"),
                                           ("threshold:1.5", r"'threshold:C' needs a number C in \(0, 1\]")])
def test_unknown_or_unusable_policy(rel_engine_dir, policy, match):
    with pytest.raises(RequestError, match=match):
        Runtime.open(rel_engine_dir, policy=policy)


def test_stop_strings_without_a_tokenizer_fail_alone(rel_runtime):
    gen = generator(rel_runtime, "fixed:4")
    bad = gen.submit([5, 6], SamplingParams(max_new_tokens=8, stop=("x",)))
    ok = gen.submit(GOOD[0], SamplingParams(max_new_tokens=8))
    run_steps(gen)
    assert "stop strings need a tokenizer" in gen.result(bad).error
    assert gen.result(ok).token_ids == ar_tokens(rel_runtime, GOOD[0], 8)


@pytest.mark.parametrize("prompt", [[1], [2, 2, 2], [3, 2, 3]], ids=["bos-only", "eos-only", "specials-only"])
def test_prompt_of_only_special_tokens_runs_and_equals_non_spec(rel_runtime, prompt):
    """A prompt made only of special tokens (BOS, EOS, <|im_start|>) is a valid request: it runs, and
    speculative output equals non-speculative output."""
    ref = ar_tokens(rel_runtime, prompt, 16)
    for policy in ("fixed:8", "dspark"):
        r = generator(rel_runtime, policy).generate([prompt], [SamplingParams(max_new_tokens=16)])[0]
        assert r.finish_reason in ("length", "stop") and r.token_ids == ref


def test_text_prompts_empty_and_special_only(rel_runtime):
    rt = rel_runtime
    rt.set_policy("fixed:4")
    res = rt.generate_text(["", "<|im_start|><|im_end|>", "ok"], SamplingParams(max_new_tokens=6))
    rt.set_policy("ar")
    assert res[0].finish_reason == "error" and "empty prompt" in res[0].error and res[0].text == ""
    assert res[1].finish_reason in ("length", "stop") and res[1].stats.prompt_tokens == 2
    assert res[2].finish_reason in ("length", "stop")


def test_prompts_file_with_invalid_utf8_and_bad_lines(rel_engine_dir, tmp_path, capsys):
    """Invalid UTF-8, a truncated JSON line, a non-string prompt, an over-capacity prompt and an empty one each fail
    on their own line (file:line named); the valid lines are generated, in order."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "ab"}\n{"prompt": "caf\xc3"}\n{"prompt": "cd"\n{"prompt": 5}\n'
                        b'{"prompt": "' + b"z" * 700 + b'"}\n{"prompt": "\xe2\x82\xac ok"}\n{"prompt": ""}\n')
    rc = cli_main(["generate", "--engine-dir", str(rel_engine_dir), "--prompts-file", str(prompts), "--json",
                   "--max-new-tokens", "6", "--policy", "fixed:4"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rc == 1 and len(rows) == 7
    assert rows[6]["finish_reason"] == "error" and "p.jsonl:7: 'prompt' is empty" in rows[6]["error"]
    assert [r["finish_reason"] for r in rows][1:5] == ["error"] * 4
    assert "p.jsonl:2: not valid UTF-8" in rows[1]["error"]
    assert "p.jsonl:3: expected a JSON object" in rows[2]["error"] and "p.jsonl:4:" in rows[3]["error"]
    assert "capacity 512" in rows[4]["error"]
    assert rows[0]["finish_reason"] in ("length", "stop") and rows[5]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("argv, match", [
    (["--temperature", "-1"], "temperature: expected a finite value >= 0, found -1.0"),
    (["--temperature", "nan"], "temperature: expected a finite value >= 0, found nan"),
    (["--top-p", "0"], "top_p: expected a value in (0, 1], found 0.0"),
    (["--max-new-tokens", "0"], "max_new_tokens: expected an integer in [1,"),
    (["--policy", "turbo"], "policy: expected one of"),
    (["--stop", ""], "stop: expected a tuple of non-empty strings"),
])
def test_cli_bad_parameters_exit_2_with_one_line(rel_engine_dir, capsys, argv, match):
    rc = cli_main(["generate", "--engine-dir", str(rel_engine_dir), "--prompt", "hi", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and match in err[-1] and "Traceback" not in "\n".join(err)


def test_release_of_a_running_or_unknown_request_is_refused(rel_runtime):
    gen = generator(rel_runtime, "ar")
    rid = gen.submit(GOOD[0], SamplingParams(max_new_tokens=4))
    with pytest.raises(RequestError, match="still running"):
        gen.release(rid)
    with pytest.raises(RequestError, match="found none"):
        gen.release(999)
    run_steps(gen)
    assert gen.release(rid).finish_reason in ("length", "stop") and gen.batch.requests == {}


def test_stop_ids_and_strings_given_as_lists_work_as_tuples(rel_runtime):
    """A direct `Generator` user passing lists (as vLLM and the OpenAI API take them) gets the same stop
    as with tuples; before, a list of stop ids was silently ignored and the request ran to its length."""
    prompt = [5, 6, 7, 8]
    base = ar_tokens(rel_runtime, prompt, 20, stop_token_ids=())
    assert SamplingParams(stop=["zz", "y"]).stop == ("zz", "y")
    params = SamplingParams(max_new_tokens=20, stop_token_ids=[base[5]])
    assert params.stop_token_ids == (base[5],)
    gen = generator(rel_runtime, "ar")
    r = gen.generate([prompt], [params])[0]
    assert r.finish_reason == "stop" and r.token_ids == base[:base.index(base[5]) + 1]
