import json

import pytest

from dspark_export.engines.manifest import SCHEMA_VERSION, EngineKey, Manifest
from dspark_export.errors import EngineDirError


def _make(tmp_path):
    (tmp_path / "graphs").mkdir()
    (tmp_path / "graphs" / "g.onnx").write_bytes(b"graph")
    graphs = {g: {"path": "graphs/g.onnx"} for g in ("target", "drafter_context", "verify")}
    graphs["drafter_block"] = {"path": "graphs/g.onnx", "spec": {"block_size": 2}}
    runtime = {"block_size": 2, "max_context": 64, "vocab_size": 10, "eos_token_ids": [2],
               "confidence_temperature": [1.0, 1.0]}
    m = Manifest(tmp_path, {"schema_version": 1, "tool": {}, "graphs": graphs,
                            "engines": [{"key": EngineKey("target", "onnxruntime", "N", 8).to_dict(),
                                         "path": "engines/onnxruntime/target.N8.json"}],
                            "runtime": runtime, "files": {}})
    m.record_files(["graphs/g.onnx"])
    m.save()
    return m


def test_round_trip(tmp_path):
    m = _make(tmp_path)
    loaded = Manifest.load(tmp_path)
    assert loaded.data == m.data
    assert loaded.engine_keys() == [EngineKey("target", "onnxruntime", "N", 8)]
    assert loaded.engine_keys()[0].path == "engines/onnxruntime/target.N8.json"


def test_schema_versions(tmp_path):
    """This version writes schema 2 and still reads a schema-1 manifest (V-wide draft logits); `true`, which
    JSON readers may take for 1, and unknown versions are refused."""
    assert SCHEMA_VERSION == 2
    m = _make(tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["schema_version"] == 2
    data = dict(m.data, schema_version=1)
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    assert Manifest.load(tmp_path).data["schema_version"] == 1
    for bad in (True, 1.0, 3, "2", None):
        (tmp_path / "manifest.json").write_text(json.dumps(dict(data, schema_version=bad)))
        with pytest.raises(EngineDirError, match=r"schema_version: expected one of \[1, 2\], found"):
            Manifest.load(tmp_path)


def test_missing_and_altered_files(tmp_path):
    _make(tmp_path)
    (tmp_path / "graphs" / "g.onnx").write_bytes(b"grapH")
    with pytest.raises(EngineDirError, match="altered: sha256"):
        Manifest.load(tmp_path)
    (tmp_path / "graphs" / "g.onnx").write_bytes(b"longer graph")
    with pytest.raises(EngineDirError, match="expected 5 bytes"):
        Manifest.load(tmp_path)
    (tmp_path / "graphs" / "g.onnx").unlink()
    with pytest.raises(EngineDirError, match="is missing"):
        Manifest.load(tmp_path)


@pytest.mark.parametrize("bad", ["../outside.onnx", "/etc/passwd", "graphs/../../x"])
def test_paths_outside_the_directory(tmp_path, bad):
    _make(tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["graphs"]["target"]["path"] = bad
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EngineDirError, match="outside|relative path"):
        Manifest.load(tmp_path)


@pytest.mark.parametrize("edit,match", [
    (lambda d: d.update(schema_version=99), r"schema_version: expected one of \[1, 2\], found 99"),
    (lambda d: d.pop("runtime"), r"missing fields \['runtime'\]"),
    (lambda d: d["runtime"].pop("vocab_size"), r"runtime.vocab_size: expected a JSON int, found None"),
    (lambda d: d["runtime"].update(block_size="seven"), r"runtime.block_size: expected a JSON int"),
    (lambda d: d["runtime"].update(block_size=3), r"must match the drafter graph's block_size 2"),
    (lambda d: d.update(runtime=[1, 2]), r"runtime: expected a JSON object, found list"),
    (lambda d: d["graphs"].pop("verify"), r"graphs: missing \['verify'\]"),
    (lambda d: d["engines"][0].update(path="../../etc/passwd"), r"does not match its key"),
    (lambda d: d["runtime"].update(max_context=-1), r"runtime.max_context: expected an integer >= 1, found -1"),
    (lambda d: d["runtime"].update(vocab_size=0), r"runtime.vocab_size: expected an integer >= 1"),
    (lambda d: d.update(engines=[]), r"engines: expected at least one engine"),
    (lambda d: d["graphs"]["target"].update(spec={"vocab_size": 256}),
     r"runtime.vocab_size 10 does not match the target graph's vocab_size 256"),
    (lambda d: d["runtime"].update(confidence_bias=[0.5]), r"runtime.confidence_bias: expected 2 finite numbers"),
    (lambda d: d["runtime"].update(confidence_bias=[0.5, "x"]), r"runtime.confidence_bias: expected 2 finite"),
], ids=["schema", "no-runtime", "no-vocab", "str-block", "block-mismatch", "runtime-list", "no-verify",
        "engine-path", "negative-context", "zero-vocab", "no-engines", "vocab-mismatch", "bias-length", "bias-type"])
def test_bad_manifest_fields(tmp_path, edit, match):
    _make(tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    edit(data)
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(EngineDirError, match=match):
        Manifest.load(tmp_path)


def test_no_manifest_is_not_an_engine_dir(tmp_path):
    with pytest.raises(EngineDirError, match="manifest.json: missing"):
        Manifest.load(tmp_path)
    with pytest.raises(EngineDirError, match="no such directory"):
        Manifest.load(tmp_path / "nope")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(EngineDirError, match="found a file"):
        Manifest.load(tmp_path / "a-file")


def test_replace_folder_reseals_and_drops_stale_entries(tmp_path):
    m = _make(tmp_path)
    m.replace_folder("report", {"index.html": b"<html>1</html>", "a.png": b"png-a"}, section="report",
                     entry={"path": "report/index.html"})
    loaded = Manifest.load(tmp_path)
    assert {k for k in loaded.data["files"] if k.startswith("report/")} == {"report/index.html", "report/a.png"}
    assert loaded.data["report"] == {"path": "report/index.html"}
    m.replace_folder("report", {"index.html": b"<html>2</html>"})
    loaded = Manifest.load(tmp_path)  # verified: sizes and hashes of the new files
    assert {k for k in loaded.data["files"] if k.startswith("report/")} == {"report/index.html"}
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["index.html"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp or old folder left
    assert loaded.data["files"]["graphs/g.onnx"] == m.data["files"]["graphs/g.onnx"]


@pytest.mark.parametrize("rel, files, match", [(".", {"x": b""}, "engine directory itself"),
                                               ("../out", {"x": b""}, "outside"),
                                               ("report", {"a/b": b""}, "plain file names")])
def test_replace_folder_refuses_bad_targets(tmp_path, rel, files, match):
    m = _make(tmp_path)
    before = (tmp_path / "manifest.json").read_bytes()
    with pytest.raises(EngineDirError, match=match):
        m.replace_folder(rel, files)
    assert (tmp_path / "manifest.json").read_bytes() == before


def test_calibration_file_and_its_errors(tmp_path):
    m = _make(tmp_path)
    assert m.calibration() is None                                        # none recorded
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "calibration.json").write_text(json.dumps({"method": "sts", "rounds": 3}))
    m.data["calibration"] = {"path": "drafter/calibration.json", "method": "sts"}
    assert m.calibration() == {"method": "sts", "rounds": 3}
    for entry, match in [("drafter/calibration.json", r"manifest.json: calibration: expected an object with a string 'path'"),
                         ({"path": 5}, "expected an object with a string 'path'"),
                         ({"path": "../outside.json"}, "calibration.path"),
                         ({"path": "drafter/missing.json"}, "missing.json: calibration: not readable JSON")]:
        m.data["calibration"] = entry
        with pytest.raises(EngineDirError, match=match):
            m.calibration()
    (tmp_path / "drafter" / "calibration.json").write_text("[1, 2]")
    m.data["calibration"] = {"path": "drafter/calibration.json"}
    with pytest.raises(EngineDirError, match="expected a JSON object, found list"):
        m.calibration()
