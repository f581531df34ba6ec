"""The command line as a whole: every command documents examples in --help, and failures are one line with a
non-zero exit code (the trace only with --verbose)."""

from __future__ import annotations

import json

import pytest

from dspark_export.cli import _parser, main

COMMANDS = [["build"], ["generate"], ["bench"], ["bench", "serve"], ["bench", "acceptance"], ["bench", "peers"],
            ["profile"], ["report"], ["export-profile"], ["inspect"], ["trt"], ["trt", "build"], ["trt", "compare"],
            ["trt", "plan"], ["serve"], ["bench", "http"]]


def _subcommands(parser, prefix=()):
    """Every (sub)command path the parser knows."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield [*prefix, name]
                yield from _subcommands(sub, (*prefix, name))


def test_the_list_covers_every_command():
    assert sorted(map(tuple, _subcommands(_parser()))) == sorted(map(tuple, COMMANDS))


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_help_has_examples(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "examples:" in out and f"dspark-export {' '.join(argv)}" in out.split("examples:", 1)[1]


@pytest.mark.parametrize("argv, needle", [
    (["generate", "--engine-dir", "{tmp}/none", "--prompt", "x"], "no such directory"),
    (["profile", "--engine-dir", "{tmp}/none"], "no such directory"),
    (["inspect", "{tmp}/none"], "no such directory"),
    (["report", "{tmp}/none"], "no such directory"),
    (["export-profile", "{tmp}/none", "--format", "generic", "--out", "{tmp}/o"], "no such directory"),
    (["bench", "peers", "--engine-dir", "{tmp}/none", "--prompt", "x"], "no such directory"),
    (["bench", "serve", "--engine-dir", "{tmp}/none"], "no such directory"),
    (["bench", "acceptance", "--engine-dir", "{tmp}/none"], "no such directory"),
    (["build", "--out", "{tmp}/file.txt"], "not a directory"),
    (["generate", "--engine-dir", "{tmp}", "--prompts-file", "{tmp}/missing.jsonl"], "prompts file not found"),
    (["generate", "--engine-dir", "{tmp}/none", "--chat", "--prompt", ""], "--prompt: expected text, found an empty"),
    (["generate", "--engine-dir", "{tmp}", "--prompt", "x", "--threads", "-1"], "threads: expected 0"),
    (["profile", "--engine-dir", "{tmp}", "--threads", "100000"], "threads: expected 0"),
])
def test_failures_are_one_line_with_exit_2(argv, needle, tmp_path, capsys):
    (tmp_path / "file.txt").write_text("x")
    code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if ": error:" in line or "internal error" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert needle in errors[0], errors[0]


def test_verbose_shows_the_trace(tmp_path):
    from dspark_export.errors import EngineDirError

    with pytest.raises(EngineDirError):
        main(["--verbose", "inspect", str(tmp_path / "none")])


def test_tables_have_a_json_form():
    """Every command that prints a table offers JSON (flag or stdout object)."""
    p = _parser()
    helps = {" ".join(a): _help(p, a) for a in (["inspect"], ["generate"], ["bench", "serve"], ["bench", "acceptance"],
                                                ["bench", "peers"])}
    assert all("--json" in h for h in helps.values()), [k for k, h in helps.items() if "--json" not in h]


def _help(parser, argv):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        parser.parse_args([*argv, "--help"])
    return buf.getvalue()


def test_progress_eta():
    from dspark_export.progress import Eta, format_seconds

    now = [0.0]
    eta = Eta(10, clock=lambda: now[0])
    assert eta.text(0) == "0/10, ETA ?"
    now[0] = 20.0
    assert eta.text(2) == "2/10, ETA 1m20s"
    assert Eta(4, start=2, clock=lambda: now[0]).remaining_s(2) is None
    assert [format_seconds(x) for x in (5, 185, 3720)] == ["5s", "3m05s", "1h02m"]
    json.dumps(eta.text(3))


def test_generate_hints_at_chat_when_raw_prompts_end_at_once():
    from dspark_export.cli import chat_hint
    from dspark_export.runtime.request import GenerationResult

    ended = GenerationResult(token_ids=[2], finish_reason="stop", stop_reason=2)
    spoke = GenerationResult(token_ids=[5, 6, 7], finish_reason="length")
    assert "1 of 2 prompt(s)" in chat_hint([ended, spoke], chat=False, has_template=True)
    assert "--chat" in chat_hint([ended], chat=False, has_template=True)
    assert chat_hint([ended], chat=True, has_template=True) is None          # already chatting
    assert chat_hint([ended], chat=False, has_template=False) is None        # a base model: nothing to suggest
    assert chat_hint([spoke], chat=False, has_template=True) is None
    cut = GenerationResult(token_ids=[9], finish_reason="length")            # max_new_tokens 1, not a stop
    assert chat_hint([cut], chat=False, has_template=True) is None
    comma = GenerationResult(token_ids=[11], finish_reason="stop", stop_reason=",")   # the user's --stop string
    assert chat_hint([comma], chat=False, has_template=True) is None
    bad = GenerationResult(finish_reason="error", error="prompt: ...")       # an unreadable line: not counted
    assert "1 of 2 prompt(s)" in chat_hint([ended, bad, spoke], chat=False, has_template=True)
