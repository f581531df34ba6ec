"""More training data written and answered by the target (training/selfdata.py; scripts/train_drafter.py data
--engine): evaluation and calibration prompts stay out, prompts are deduplicated, every stage resumes."""

from __future__ import annotations

import json

import pytest

from dspark_export.datasets import default_datasets_dir, read_dataset
from dspark_export.errors import ConfigError
from dspark_export.training import selfdata
from dspark_export.training.data import append_jsonl, read_records
from dspark_export.training.split import EVAL_ONLY, load_split, split_rows
from dspark_export.training.selfdata import PromptFilter, clean_generated_prompt, normalize_prompt, reserved_prompts

from ..conftest import TINY_BUILD
from ..script_loader import load_script

needs_datasets = pytest.mark.skipif(default_datasets_dir() is None, reason="../shared/eval_datasets is not present")


def test_normalize_and_clean():
    assert normalize_prompt("  What IS 2+3?\n") == normalize_prompt("what is 2 + 3") == "what is 2 3"
    assert normalize_prompt("Ｃａｆé — “quoted”") == "café quoted"  # NFKC, case-folded, punctuation dropped
    assert clean_generated_prompt('Question: "How do I boil an egg?"') == "How do I boil an egg?"
    assert clean_generated_prompt("User's message:  Sort a list in Python ") == "Sort a list in Python"
    assert clean_generated_prompt('A person might ask, \u201cWhy is the sky blue?\u201d') == "Why is the sky blue?"
    assert clean_generated_prompt("A person might ask:\n\nWhat is SQL?") == "What is SQL?"


def test_prompt_filter_keeps_evaluation_prompts_out_exactly_and_normalised():
    f = PromptFilter(reserved=["What is the capital of France?"], seen=["Tell me a joke."], min_chars=5, max_chars=60)
    assert f.check("What is the capital of France?") == "reserved"          # exact
    assert f.check("what is the capital of france") == "reserved"           # normalised
    assert f.check("  WHAT is the capital of France ?!") == "reserved"
    assert f.check("tell me a JOKE") == "duplicate"                          # a training prompt
    assert f.check("How do tides work?") == "ok"
    assert f.check("How do tides work") == "duplicate"                       # accepted once only
    assert f.check("Hi?") == "short" and f.check("x" * 61) == "long" and f.check("?!") == "short"
    assert f.check("A cut-off question about", finish_reason="length") == "truncated"


@needs_datasets
def test_training_prompts_are_disjoint_from_evaluation_and_calibration_prompts_by_text():
    """Row-level disjointness is test_split.py's; here the texts: no training prompt equals (exact or normalised)
    an evaluation or calibration prompt of any dataset, and the evaluation-only datasets are reserved whole."""
    folder = default_datasets_dir()
    split = load_split(datasets_dir=folder)
    reserved = reserved_prompts(split, folder)
    for name in EVAL_ONLY:
        assert {normalize_prompt(t) for t in read_dataset(folder / f"{name}.jsonl")} <= reserved
    train = split_rows(split, "train")
    texts = {n: read_dataset(folder / f"{n}.jsonl") for n in {n for n, _ in train}}
    assert not any(n in EVAL_ONLY for n, _ in train)
    clash = [(n, k) for n, k in train if normalize_prompt(texts[n][k]) in reserved]
    assert not clash, clash[:5]


class _Scripted:
    """A Responder whose outputs are scripted texts (the filters and the resume logic, without a model)."""

    name = "scripted"

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.calls = tokenizer, list(texts), []

    def generate(self, prompts, temperatures, seeds, max_new_tokens, top_p=1.0, on_result=None):
        self.calls.append(len(prompts))
        out = []
        for _ in prompts:
            text = self.texts.pop(0) if self.texts else "fallback answer"
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][:max_new_tokens]
            out.append((ids + [2], "stop"))
        return out


@needs_datasets
def test_self_prompts_drop_evaluation_prompts_and_duplicates_and_resume(tiny_target_dir, tmp_path):
    from transformers import AutoTokenizer

    folder = default_datasets_dir()
    split = load_split(datasets_dir=folder)
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    eval_text = read_dataset(folder / "gsm8k.jsonl")[split["datasets"]["gsm8k"]["eval"][0]]
    cal_name = next(n for n, e in split["datasets"].items() if e["calibration"])
    cal_text = read_dataset(folder / f"{cal_name}.jsonl")[split["datasets"][cal_name]["calibration"][0]]
    responder = _Scripted(tok, ["How do tides work?", eval_text.upper(), "how do TIDES work", cal_text,
                                "Explain recursion simply.", "ok"])
    path = tmp_path / "self_prompts.jsonl"
    stats = selfdata.write_self_prompts(responder, split, folder, path, 6, seed=1, concurrency=4, max_new_tokens=4000)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "reserved", "duplicate", "reserved", "ok", "short"]
    assert stats == {"ok": 2, "reserved": 2, "duplicate": 1, "short": 1} and responder.calls == [4, 2]
    assert [r["domain"] for r in rows[:2]] == list(selfdata.DOMAINS[:2]) and rows[1]["seed"] == 1_000_003 + 1
    # resumable: more requests write only the new rows, and a repeat of an accepted prompt is still a duplicate
    responder.texts = ["Explain recursion simply!"]
    selfdata.write_self_prompts(responder, split, folder, path, 7, seed=1, concurrency=4)
    assert [json.loads(x)["status"] for x in path.read_text().splitlines()][6:] == ["duplicate"]
    out = tmp_path / "train.jsonl"
    assert selfdata.answer_self_prompts(responder, path, out, concurrency=2, max_new_tokens=16) == 2
    assert selfdata.answer_self_prompts(responder, path, out, concurrency=2) == 0  # all done
    recs = read_records(out)
    assert [(r["dataset"], r["row"]) for r in recs] == [("self-written", 0), ("self-written", 4)]
    assert recs[0]["prompt_ids"] == list(tok.apply_chat_template([{"role": "user", "content": "How do tides work?"}],
                                                                 add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False))


class _Interrupted(_Scripted):
    """Streams its first `land` answers through on_result, then dies as a killed process would."""

    def __init__(self, tokenizer, land):
        super().__init__(tokenizer, [])
        self.land = land

    def generate(self, prompts, temperatures, seeds, max_new_tokens, top_p=1.0, on_result=None):
        outs = super().generate(prompts, temperatures, seeds, max_new_tokens, top_p)
        for i in reversed(range(len(prompts))[-self.land:]):  # in finish order, not prompt order
            on_result(i, outs[i])
        raise KeyboardInterrupt


def test_answers_land_as_they_finish_and_an_interrupted_call_loses_only_those_in_flight(tiny_target_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    jobs = [{"dataset": "d", "row": k, "messages": [{"role": "user", "content": f"question {k}"}]} for k in range(6)]
    out = tmp_path / "train.jsonl"
    kw = dict(max_new_tokens=8, max_prompt_tokens=384, sampled_fraction=0.0, temperature=1.0, seed=0,
              concurrency=6, say=lambda line: None, what="t")
    with pytest.raises(KeyboardInterrupt):
        selfdata._answer(_Interrupted(tok, 2), jobs, out, **kw)
    assert [r["row"] for r in read_records(out)] == [5, 4]  # on disk before the call died
    with out.open("a") as f:
        f.write('{"dataset": "d", "ro')  # and a write cut off mid-line
    responder = _Scripted(tok, [])
    assert selfdata._answer(responder, jobs, out, **kw) == 4
    assert responder.calls == [4] and sorted(r["row"] for r in read_records(out)) == list(range(6))


def test_a_whole_last_row_without_its_newline_is_kept(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"a": 1}\n' + '{"b": "' + "x" * 70000 + '"}')  # longer than the backwards scan's block
    append_jsonl(path, [{"c": 3}])
    assert [list(json.loads(x)) for x in path.read_text().splitlines()] == [["a"], ["b"], ["c"]]
    path.write_text('{"a": 1')  # no newline anywhere: nothing whole to keep
    append_jsonl(path, [{"c": 3}])
    assert path.read_text() == '{"c": 3}\n'


class _RuntimeWithStops:
    """The script's RuntimeResponder on a tiny random engine, with extra stop ids so that a random model's
    outputs end with a stop (as a real target's do) and pass the filters."""

    def __init__(self, engine_dir):
        self.inner = load_script("train_drafter.py").RuntimeResponder(str(engine_dir), "dspark")
        self.tokenizer, self.name = self.inner.tokenizer, self.inner.name
        self.stops = tuple(range(40, 100))

    def generate(self, prompts, temperatures, seeds, max_new_tokens, top_p=1.0, on_result=None):
        from dspark_export.runtime.request import SamplingParams

        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=t, top_p=top_p if t else 1.0, seed=s,
                                 stop_token_ids=self.stops)
                  for t, s in zip(temperatures, seeds)]
        done = None if on_result is None else (lambda i, r: on_result(i, (list(r.token_ids), r.finish_reason)))
        return [(list(r.token_ids), r.finish_reason) for r in self.inner.runtime.generate_ids(prompts, params, done)]


@pytest.fixture(scope="module")
def data_engine_dir(build_tiny_engine_dir):
    return build_tiny_engine_dir("selfdata_engines", **{**TINY_BUILD, "max_context": 512})


@needs_datasets
def test_the_three_sources_end_to_end_on_a_tiny_engine(data_engine_dir, tmp_path):
    """(a) split prompts, (b) self-written prompts, (c) multi-turn, through the project's runtime at concurrency."""
    folder = default_datasets_dir()
    split = load_split(datasets_dir=folder)
    r = _RuntimeWithStops(data_engine_dir)
    out = tmp_path / "train.jsonl"
    kw = dict(max_new_tokens=6, max_prompt_tokens=480, concurrency=4, seed=3)
    n_split = selfdata.answer_split(r, split, "train", folder, out, limit=3, sampled_fraction=0.5, **kw)
    assert 1 <= n_split <= 3
    stats = selfdata.write_self_prompts(r, split, folder, tmp_path / "self.jsonl", 8, seed=3, concurrency=4,
                                        max_new_tokens=24, min_chars=1)
    assert sum(stats.values()) == 8 and stats.get("ok", 0) >= 1, stats
    n_self = selfdata.answer_self_prompts(r, tmp_path / "self.jsonl", out, **kw)
    assert n_self == stats["ok"]
    fstats = selfdata.write_follow_ups(r, split, folder, out, tmp_path / "follow.jsonl", 8, seed=3, concurrency=4,
                                       max_new_tokens=24, min_chars=1, max_prompt_tokens=500)
    assert fstats.get("ok", 0) >= 1, fstats
    n_turn = selfdata.answer_follow_ups(r, tmp_path / "follow.jsonl", out, **{**kw, "max_prompt_tokens": 500})
    assert n_turn == fstats["ok"]
    recs = read_records(out)
    assert len(recs) == n_split + n_self + n_turn and len({(x["dataset"], x["row"]) for x in recs}) == len(recs)
    assert all(1 <= len(x["response_ids"]) <= 6 and x["dtype"].startswith("engine:") for x in recs)
    train_rows = set(split_rows(split, "train"))
    assert all((x["dataset"], x["row"]) in train_rows for x in recs[:n_split])
    for x in recs[n_split + n_self:]:
        assert x["dataset"].startswith("multi-turn:") and x["turns"] == 3
    # everything resumes: a second pass writes nothing new
    assert selfdata.answer_split(r, split, "train", folder, out, limit=3, **kw) == 0
    assert selfdata.answer_self_prompts(r, tmp_path / "self.jsonl", out, **kw) == 0
    assert len(read_records(out)) == len(recs)


@needs_datasets
def test_data_script_with_engine(data_engine_dir, tmp_path):
    main = load_script("train_drafter.py").main
    run = ["data", "--run", str(tmp_path / "run"), "--engine", str(data_engine_dir), "--limit", "2",
           "--calibration-limit", "2", "--max-new-tokens", "6", "--concurrency", "2", "--self-prompts", "3",
           "--multi-turn", "2", "--max-prompt-tokens", "480", "--max-turn-tokens", "500"]
    assert main(run) == 0
    data = tmp_path / "run" / "data"
    assert len(read_records(data / "train.jsonl")) >= 1 and len(read_records(data / "calibration.jsonl")) <= 2
    assert len((data / "self_prompts.jsonl").read_text().splitlines()) == 3
    cal_rows = set(split_rows(load_split(), "calibration"))
    assert all((x["dataset"], x["row"]) in cal_rows for x in read_records(data / "calibration.jsonl"))
    size = (data / "train.jsonl").stat().st_size
    assert main(run) == 0 and (data / "train.jsonl").stat().st_size == size  # resumed: nothing to do
    assert main(["data", "--run", str(tmp_path / "r2"), "--self-prompts", "2"]) == 2  # needs --engine


def test_record_domains():
    from dspark_export.training.selfdata import DOMAINS, TOPIC_DOMAIN, record_domain

    assert record_domain({"dataset": "gsm8k", "row": 4}) == "math"
    assert record_domain({"dataset": "lbpp", "row": 0}) == record_domain({"dataset": "mbpp", "row": 0}) == "code"
    assert record_domain({"dataset": "arena-hard-v2", "row": 1}) == "chat"
    k = DOMAINS.index("SQL and databases")
    assert record_domain({"dataset": "self-written", "row": k + 2 * len(DOMAINS)}) == "code"
    assert record_domain({"dataset": "multi-turn:self-written", "row": DOMAINS.index("travel")}) == "chat"
    assert record_domain({"dataset": "multi-turn:aime24", "row": 3}) == "math"
    assert sorted(set(TOPIC_DOMAIN.values())) == ["chat", "code", "math"] and set(TOPIC_DOMAIN) == set(DOMAINS)
    with pytest.raises(ConfigError, match="'toy' has no domain"):
        record_domain({"dataset": "toy", "row": 0})


def test_every_training_dataset_has_a_domain():
    from dspark_export.training.selfdata import record_domain

    for name in load_split()["datasets"]:
        if name not in EVAL_ONLY:
            assert record_domain({"dataset": name, "row": 0}) in ("math", "code", "chat")
