"""training.snapshot: a run's append-only data files packed as shards and restored, checked both ways."""

from __future__ import annotations

import json

import pytest

from dspark_export.errors import ConfigError
from dspark_export.training.snapshot import INDEX, pack, unpack

from ..script_loader import load_script


def _rows(path, rows, partial=""):
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        f.write(partial)


def test_pack_appends_only_new_whole_lines_and_unpack_restores(tmp_path):
    data, snap = tmp_path / "run" / "data", tmp_path / "snap"
    data.mkdir(parents=True)
    _rows(data / "train.jsonl", [{"row": i} for i in range(3)], partial='{"row": 3')  # a line still being written
    _rows(data / "self_prompts.jsonl", [{"row": 0, "text": "héllo"}])
    assert pack(data, snap) == {"self_prompts.jsonl": 1, "train.jsonl": 3}
    assert pack(data, snap) == {}  # nothing new: no empty shard
    with (data / "train.jsonl").open("a") as f:
        f.write("}\n")
    _rows(data / "train.jsonl", [{"row": 4}])
    assert pack(data, snap) == {"train.jsonl": 2}
    index = json.loads((snap / INDEX).read_text())
    assert [s["shard"] for s in index["files"]["train.jsonl"]] == ["train.000.jsonl.xz", "train.001.jsonl.xz"]
    assert index["files"]["train.jsonl"][-1]["lines"] == 5

    fresh = tmp_path / "fresh" / "data"
    assert unpack(snap, fresh) == {"self_prompts.jsonl": 1, "train.jsonl": 5}
    for name in ("train.jsonl", "self_prompts.jsonl"):
        assert (fresh / name).read_bytes() == (data / name).read_bytes()
    assert unpack(snap, fresh) == {}  # already there
    _rows(fresh / "train.jsonl", [{"row": 5}])  # the data stage went on: the longer file is kept
    assert unpack(snap, fresh) == {} and len((fresh / "train.jsonl").read_text().splitlines()) == 6


def test_unpack_replaces_a_shorter_prefix(tmp_path):
    data, snap, other = tmp_path / "a", tmp_path / "snap", tmp_path / "b"
    data.mkdir()
    other.mkdir()
    _rows(data / "train.jsonl", [{"row": i} for i in range(4)])
    pack(data, snap)
    _rows(other / "train.jsonl", [{"row": 0}])
    assert unpack(snap, other) == {"train.jsonl": 4}
    assert (other / "train.jsonl").read_bytes() == (data / "train.jsonl").read_bytes()


def test_disagreeing_files_are_refused_and_left_untouched(tmp_path):
    data, snap = tmp_path / "a", tmp_path / "snap"
    data.mkdir()
    _rows(data / "train.jsonl", [{"row": 0}, {"row": 1}])
    pack(data, snap)
    before = {p.name: p.read_bytes() for p in snap.iterdir()}
    (data / "train.jsonl").write_text(json.dumps({"row": 9}) + "\n" + json.dumps({"row": 1}) + "\n")
    with pytest.raises(ConfigError, match=r"train\.jsonl: does not continue the snapshot"):
        pack(data, snap)
    assert {p.name: p.read_bytes() for p in snap.iterdir()} == before
    with pytest.raises(ConfigError, match=r"differs from the snapshot's train\.jsonl"):
        unpack(snap, data)
    assert json.loads((data / "train.jsonl").read_text().splitlines()[0]) == {"row": 9}
    with pytest.raises(ConfigError, match="no shards.json"):
        unpack(tmp_path / "nothing", data)


def test_a_damaged_shard_is_named(tmp_path):
    data, snap = tmp_path / "a", tmp_path / "snap"
    data.mkdir()
    _rows(data / "train.jsonl", [{"row": 0}])
    pack(data, snap)
    index = json.loads((snap / INDEX).read_text())
    index["files"]["train.jsonl"][-1]["sha256"] = "0" * 64
    (snap / INDEX).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"the shards of train\.jsonl do not match shards\.json"):
        unpack(snap, tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_script_pack_and_unpack(tmp_path):
    main = load_script("train_drafter.py").main
    (tmp_path / "run" / "data").mkdir(parents=True)
    _rows(tmp_path / "run" / "data" / "train.jsonl", [{"row": 0}])
    assert main(["pack", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "snap")]) == 0
    assert main(["unpack", "--run", str(tmp_path / "new"), "--from", str(tmp_path / "snap")]) == 0
    assert (tmp_path / "new" / "data" / "train.jsonl").read_text() == '{"row": 0}\n'
    assert main(["unpack", "--run", str(tmp_path / "new"), "--from", str(tmp_path / "none")]) == 2


def test_damaged_or_foreign_snapshots_are_named(tmp_path):
    data, snap = tmp_path / "a", tmp_path / "snap"
    with pytest.raises(ConfigError, match="expected the data stage's .*no such folder"):
        pack(data, snap)
    data.mkdir()
    with pytest.raises(ConfigError, match="found none"):
        pack(data, snap)
    _rows(data / "train.jsonl", [{"row": 0}, {"row": 1}])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="expected a snapshot folder, found a file"):
        pack(data, tmp_path / "file")
    pack(data, snap)
    shard = snap / "train.000.jsonl.xz"
    good = shard.read_bytes()
    shard.write_bytes(good[:10] + b"garbage" + good[17:])
    with pytest.raises(ConfigError, match=r"train\.000\.jsonl\.xz: not a readable xz shard of train\.jsonl"):
        unpack(snap, tmp_path / "b")
    shard.unlink()
    with pytest.raises(ConfigError, match=r"train\.000\.jsonl\.xz: missing"):
        unpack(snap, tmp_path / "b")
    with pytest.raises(ConfigError, match=r"shards listed in shards\.json are missing: \['train\.000\.jsonl\.xz'\]"):
        pack(data, snap)
    shard.write_bytes(good)
    (data / "train.jsonl").write_text("")
    with pytest.raises(ConfigError, match="fewer than the .* a data file only grows"):
        pack(data, snap)
    index = json.loads((snap / INDEX).read_text())
    index["files"]["../../escaped.jsonl"] = index["files"]["train.jsonl"]
    (snap / INDEX).write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"file name '\.\./\.\./escaped\.jsonl': expected a plain"):
        unpack(snap, tmp_path / "b")
    (snap / INDEX).write_text("{not json")
    with pytest.raises(ConfigError, match="shards.json: not valid JSON"):
        unpack(snap, tmp_path / "b")
    assert not (tmp_path / "b").exists() and not (tmp_path / "escaped.jsonl").exists()
