"""Failure-case rows that need real text, on the real default model (marked `real_model`).

Runs on the session's build of the embedded default (SmolLM2-135M-Instruct with its trained drafter),
`real_engine_dir` in tests/conftest.py: built once per session, or $DSPARK_ENGINE_DIR when set.
"""

from __future__ import annotations

import pytest

from dspark_export.runtime.request import SamplingParams
from ..runtime.self_draft import TargetDrafter

from .conftest import generator

pytestmark = pytest.mark.real_model

TEXT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May? Explain step by step.")


@pytest.fixture(scope="module")
def real_rt(real_engine_dir):
    from dspark_export.runtime.api import Runtime

    return Runtime.open(real_engine_dir, policy="ar")


def _run(rt, policy, prompt, n, drafter=None, **params):
    gen = generator(rt, policy, drafter=drafter, detokenize=rt.decode)
    return gen.generate([prompt], [SamplingParams(max_new_tokens=n, **params)])[0]


def _full_block(rt) -> str:
    """fixed:γ, every draft of the shipped drafter's block verified."""
    return f"fixed:{rt.engines.manifest.runtime['block_size']}"


def test_sd03_chat_template_special_tokens(real_rt):
    """SD-03: the chat template's special tokens are single ids in the prompt (not spelled out), and
    spec output equals non-spec greedy for the same ids."""
    ids = real_rt.encode(TEXT, chat=True)
    im_start = real_rt.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(im_start) >= 2
    ref = _run(real_rt, "ar", ids, 48).token_ids
    for policy in ("dspark", _full_block(real_rt)):
        assert _run(real_rt, policy, ids, 48).token_ids == ref, policy


def test_sd04_sd18_self_draft_on_the_real_model(real_rt):
    """SD-04/SD-18 on SmolLM2 fp32: the target drafting for itself (k=4) is accepted 100 %."""
    ids = real_rt.encode(TEXT, chat=True)
    r = _run(real_rt, "fixed:4", ids, 40, drafter=TargetDrafter())
    assert r.token_ids == _run(real_rt, "ar", ids, 40).token_ids
    assert r.stats.accepted_tokens == r.stats.draft_tokens > 20


def test_sd14_stop_strings_on_real_text(real_rt):
    """SD-14: stop strings taken from the model's own greedy text (a two-character span late in the
    text, and '\\n' / a non-ASCII character when the text has one): spec == non-spec, text ends
    before the stop string."""
    ids = real_rt.encode(TEXT, chat=True)
    plain = _run(real_rt, "ar", ids, 64)
    text = real_rt.decode(plain.token_ids)
    stops = [text[len(text) // 2:len(text) // 2 + 2]]
    stops += [c for c in text if ord(c) > 127][:1] + (["\n"] if "\n" in text else [])
    for stop in stops:
        ref = _run(real_rt, "ar", ids, 64, stop=(stop,))
        assert ref.finish_reason == "stop" and ref.stop_reason == stop
        for policy in ("dspark", _full_block(real_rt)):
            r = _run(real_rt, policy, ids, 64, stop=(stop,))
            assert r.token_ids == ref.token_ids and r.stop_reason == stop, (policy, stop)
        cut = real_rt.text_of(ref)
        assert stop not in cut and text.startswith(cut)


def test_sd21_sd35_long_prompt_spec_equals_non_spec(real_rt):
    """SD-21/SD-35: a ~2100-token prompt in the 4096-token engine, 200 new tokens: spec == non-spec."""
    base = real_rt.encode(TEXT + " ", chat=False)
    prompt = (base * (2100 // len(base) + 1))[:2100]
    ref = _run(real_rt, "ar", prompt, 200)
    assert len(ref.token_ids) == 200 or ref.finish_reason == "stop"
    assert _run(real_rt, "dspark", prompt, 200).token_ids == ref.token_ids
