"""Triton kernels of dspark::MarkovDraft and dspark::SpeculativeVerify: the numpy reference's choices in
Triton's CPU interpreter (through the registry), the boundary checks, the gate, and PTX for sm_90 without a GPU.

The kernels run in a worker process started with TRITON_INTERPRET=1 (``triton_interpreter.py`` says
why it cannot be set in this process), through ``OP_REGISTRY[op].triton``; the reference runs here.
Sizes are small (V 37 and 50 with BLOCK_V 16, so the tail block is masked; γ <= 4) to keep the
interpreter fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from dspark_export.errors import PluginError
from dspark_export.plugins.common import triton_support
from dspark_export.plugins.markov_draft import reference as markov_reference
from dspark_export.plugins.markov_draft.schema import scatter_draft_logits
from dspark_export.plugins.registry import OP_REGISTRY
from dspark_export.plugins.speculative_verify import reference as verify_reference
from dspark_export.plugins.common.triton_support import has_triton
from plugin_cases import MARKOV_CONFIGS, SAMPLING_CASES, draft_vocab_feeds, markov_feeds, sampling_feeds, verify_feeds
from triton_interpreter import InterpreterWorker

F32, I64 = np.float32, np.int64
OPTIONS = dict(block_v=16, num_probes=16)  # V = 37, 50: masked tail blocks; 16 probes: fewest search passes
needs_triton = pytest.mark.skipif(
    not has_triton(), reason="triton does not import (pip install 'dspark-export[triton]'), so the kernels cannot run")


@pytest.fixture(scope="module")
def worker():
    interpreter = InterpreterWorker()
    yield interpreter
    interpreter.close()


def _tensors(feeds: dict) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array.copy()) for name, array in feeds.items()}


def _run(worker, op_type: str, feeds: dict, **options) -> dict[str, np.ndarray]:
    """The kernel's outputs; also checks that it left its inputs unchanged."""
    outputs, inputs_after = worker.run(op_type, feeds, **(OPTIONS | options))
    for name, array in feeds.items():
        np.testing.assert_array_equal(inputs_after[name], array, err_msg=f"input {name!r} was modified")
    return outputs


def _check_markov(worker, feeds: dict, **options) -> dict[str, np.ndarray]:
    actual = _run(worker, "MarkovDraft", feeds, **options)
    expected = markov_reference.run(feeds)
    np.testing.assert_array_equal(actual["draft_ids"], expected["draft_ids"])
    np.testing.assert_allclose(actual["draft_logits"], expected["draft_logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(actual["confidence"], expected["confidence"], rtol=1e-5, atol=1e-6)
    assert {name: actual[name].dtype for name in expected} == {name: value.dtype for name, value in expected.items()}
    return actual


def _check_verify(worker, feeds: dict, **options) -> tuple[list[int], list[int]]:
    actual = _run(worker, "SpeculativeVerify", feeds, **options)
    expected = verify_reference.run(feeds)
    assert actual["num_accepted"].tolist() == expected["num_accepted"].tolist()
    assert actual["next_ids"].tolist() == expected["next_ids"].tolist()
    assert actual["num_accepted"].dtype == actual["next_ids"].dtype == np.int64
    return actual["num_accepted"].tolist(), actual["next_ids"].tolist()


# --- MarkovDraft ---

MARKOV_CASES = (
    [("markov_conf", case, 37) for case in SAMPLING_CASES]  # greedy, t0.7, t1.3, top_k, top_p, mixed
    + [(config, "mixed", 50) for config in ("markov", "conf", "plain")]
    + [("plain", "ties", 50), ("markov_conf", "ties", 37)]
)


@needs_triton
@pytest.mark.parametrize("config_tag, case, vocab", MARKOV_CASES)
def test_markov_draft_matches_reference(worker, config_tag, case, vocab):
    config = dict(block_size=3, **MARKOV_CONFIGS[config_tag])
    has_ties = case == "ties"  # logits in steps of 0.5: argmax, top-k and top-p ties
    rng = np.random.default_rng(zlib.crc32(f"{config_tag}/{case}/{vocab}".encode()))
    feeds = markov_feeds(rng, "mixed" if has_ties else case, config, num_requests=6, vocab=vocab, has_ties=has_ties)
    _check_markov(worker, feeds)


@needs_triton
def test_markov_bias_conditions_on_the_previous_draft(worker):
    """V = 5 (one masked block), identity W1 and W2 = 10 · (x → x+1 mod 5): greedy walks the chain."""
    vocab, gamma = 5, 4
    feeds = dict(
        base_logits=np.zeros((2, gamma, vocab), F32), hidden=np.zeros((2, gamma, 3), F32),
        anchor_ids=np.array([0, 3], I64), **sampling_feeds("greedy", 2), uniforms=np.full((2, gamma), 0.5, F32),
        confidence_temperature=np.ones(gamma, F32),
        markov_w1=np.eye(vocab, dtype=F32), markov_w2=np.roll(np.eye(vocab, dtype=F32), 1, axis=0) * 10,
    )
    actual = _check_markov(worker, feeds)
    np.testing.assert_array_equal(actual["draft_ids"], [[1, 2, 3, 4], [4, 0, 1, 2]])
    np.testing.assert_array_equal(actual["draft_logits"][1, 1], [10, 0, 0, 0, 0])
    np.testing.assert_array_equal(actual["confidence"], np.ones((2, gamma), F32))


@needs_triton
def test_markov_draft_long_hidden_and_other_blocks(worker):
    """H = 300 spans two hidden blocks (256 + a masked tail); BLOCK_V 32 and plain bisection (1 probe)."""
    config = dict(block_size=2, has_markov=True, has_confidence=True)
    feeds = markov_feeds(np.random.default_rng(7), "mixed", config, num_requests=6, vocab=50, hidden=300)
    _check_markov(worker, feeds, block_v=32, num_probes=1)


@needs_triton
def test_markov_draft_one_hot_rows_and_single_request(worker):
    """A row whose logits are one-hot at every temperature, with top-k 1 and top-p 0 (only the top-1 survives)."""
    config = dict(block_size=2, has_markov=False, has_confidence=False)
    feeds = markov_feeds(np.random.default_rng(3), "t1.3", config, num_requests=1, vocab=37)
    feeds["base_logits"] = np.full_like(feeds["base_logits"], -50.0)
    feeds["base_logits"][0, :, 33] = 50.0  # in the masked tail block
    for top_k, top_p in ((0, 1.0), (1, 1.0), (0, 0.0)):
        feeds.update(top_k=np.array([top_k], I64), top_p=np.array([top_p], F32))
        np.testing.assert_array_equal(_check_markov(worker, feeds)["draft_ids"], [[33, 33]])


@needs_triton
@pytest.mark.parametrize("config_tag, case", [("markov_conf", "mixed"), ("markov", "top_p"), ("markov_conf", "ties")])
def test_markov_draft_over_a_draft_vocabulary(worker, config_tag, case):
    """d2t (Vd = 13 of V = 50, a masked tail block): the reference's drafts, and the scatter-then-full-V path's
    (its logits are the kernel's scattered to V)."""
    config = dict(block_size=3, **MARKOV_CONFIGS[config_tag])
    rng = np.random.default_rng(zlib.crc32(f"d2t/{config_tag}/{case}".encode()))
    has_ties = case == "ties"
    feeds = markov_feeds(rng, "mixed" if has_ties else case, config, num_requests=6, vocab=50, has_ties=has_ties)
    d2t = np.sort(rng.choice(50, 13, replace=False))
    d2t[-1] = 49  # the last column, in the masked tail block
    d2t = np.unique(d2t)
    scattered, draft = draft_vocab_feeds(feeds, d2t)
    actual = _check_markov(worker, draft)
    full = markov_reference.run(scattered)
    np.testing.assert_array_equal(actual["draft_ids"], full["draft_ids"])
    assert actual["draft_logits"].shape == (6, 3, len(d2t))   # over the draft vocabulary
    np.testing.assert_allclose(scatter_draft_logits(actual["draft_logits"], d2t, 50), full["draft_logits"],
                               rtol=1e-6, atol=1e-6)
    assert np.isin(actual["draft_ids"], d2t).all()


# --- SpeculativeVerify ---

RAGGED_LENS = [3, 0, 4, 1, 2, 4]


@needs_triton
@pytest.mark.parametrize("case, vocab", [(case, 37) for case in SAMPLING_CASES] + [("mixed", 50), ("ties", 50)])
def test_verify_matches_reference_on_ragged_batches(worker, case, vocab):
    has_ties = case == "ties"
    rng = np.random.default_rng(zlib.crc32(f"{case}/{vocab}".encode()))
    feeds = verify_feeds(rng, "mixed" if has_ties else case, RAGGED_LENS, gamma=4, vocab=vocab, has_ties=has_ties)
    _check_verify(worker, feeds)


def _hand_feeds(target_probs, draft_probs, draft_ids, verify_lens, uniforms, temperature=1.0, top_k=0, top_p=1.0):
    """Verify feeds from probability rows (logits = log p, floored), packed back to back, V = 20 (two blocks)."""
    verify_lens = np.array(verify_lens, I64)
    num_requests = len(verify_lens)
    vocab = 20

    def logits(rows):
        padded = np.zeros((len(rows), vocab))
        padded[:, :len(rows[0])] = rows
        with np.errstate(divide="ignore"):
            return np.maximum(np.log(padded), -80).astype(F32)

    return dict(
        target_logits=logits(target_probs), query_start=np.concatenate([[0], np.cumsum(verify_lens + 1)]).astype(I64),
        draft_ids=np.array(draft_ids, I64), draft_logits=logits(draft_probs).reshape(num_requests, -1, vocab),
        verify_lens=verify_lens, temperature=np.full(num_requests, temperature, F32),
        top_k=np.full(num_requests, top_k, I64), top_p=np.full(num_requests, top_p, F32),
        uniforms=np.array(uniforms, F32),
    )


BONUS = [0.1, 0.2, 0.3, 0.4]  # u = 0.35 -> token 2; greedy -> token 3


@needs_triton
def test_verify_edge_cases(worker):
    rows = [[0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]]
    # All accepted (q == p): the bonus sample of the last row.
    assert _check_verify(worker, _hand_feeds(rows + [BONUS], rows, [[1, 2]], [2], [[0.9, 0.9, 0.35]])) == ([2], [2])
    # First rejected: u·q(3) = 0.35 >= p(3) = 0.1; the residual [0, .4, .2, 0] at u = 0.7 -> 2.
    target, draft = [[0.1, 0.5, 0.3, 0.1], BONUS, BONUS], [[0.1, 0.1, 0.1, 0.7], [0.25] * 4]
    assert _check_verify(worker, _hand_feeds(target, draft, [[3, 1]], [2], [[0.5, 0.0, 0.7]])) == ([0], [2])
    # Empty drafts (verify_len 0, placeholder ids): the bonus sample of the only row; greedy: its argmax.
    for temperature, expected in ((1.0, 2), (0.0, 3)):
        feeds = _hand_feeds([BONUS, BONUS], [[0.25] * 4] * 2, [[-1], [-1]], [0, 0], [[0.5, 0.35]] * 2, temperature)
        assert _check_verify(worker, feeds) == ([0, 0], [expected, expected])
    # One-hot draft distributions: q(x) = 1, so x is accepted iff u < p(x); the residual of a one-hot q.
    one_hot = [[0, 0, 1, 0], [0, 1, 0, 0]]
    target = [[0.1, 0.2, 0.6, 0.1], [0.1, 0.3, 0.4, 0.2], BONUS]
    feeds = _hand_feeds(target, one_hot, [[2, 1]], [2], [[0.5, 0.31, 0.99]])
    # 0.5 < 0.6: accepted; 0.31 >= 0.3: rejected; the residual [.1, 0, .4, .2] at u = 0.99 -> 3.
    assert _check_verify(worker, feeds) == ([1], [3])
    # A draft outside top-k 1 of p == q: rejected (0 < 0 fails) and the residual is all zero: sample p (the top-1).
    feeds = _hand_feeds([BONUS, BONUS], [BONUS], [[1]], [1], [[0.2, 0.9]], top_k=1)
    assert _check_verify(worker, feeds, check_values=False) == ([0], [3])


# --- boundary checks, registry, gate ---

def _verify_tensors() -> dict[str, torch.Tensor]:
    return _tensors(verify_feeds(np.random.default_rng(0), "t0.7", [2, 1], gamma=2, vocab=37))


@needs_triton
def test_wrappers_raise_the_reference_errors():
    """The checks run before any launch, so the kernel modules are imported here (not in interpreter mode)."""
    from dspark_export.plugins.markov_draft import triton_kernel as markov_kernel
    from dspark_export.plugins.speculative_verify import triton_kernel as verify_kernel

    tensors = _verify_tensors()
    with pytest.raises(PluginError, match="'target_logits'.*float64"):
        verify_kernel.run({**tensors, "target_logits": tensors["target_logits"].double()}, **OPTIONS)
    with pytest.raises(PluginError, match="'query_start'"):
        verify_kernel.run({**tensors, "query_start": torch.tensor([0, 2, 4])}, **OPTIONS)
    with pytest.raises(PluginError, match="'uniforms'.*in \\[0, 1\\)"):
        verify_kernel.run({**tensors, "uniforms": torch.ones_like(tensors["uniforms"])}, **OPTIONS)
    with pytest.raises(PluginError, match="block_v must be a power of two"):
        verify_kernel.run(tensors, block_v=24)
    with pytest.raises(PluginError, match="one device"):
        verify_kernel.run({**tensors, "uniforms": tensors["uniforms"].to("meta")}, **OPTIONS)
    config = dict(block_size=2, **MARKOV_CONFIGS["markov_conf"])
    feeds = _tensors(markov_feeds(np.random.default_rng(0), "greedy", config))
    del feeds["markov_w2"]
    with pytest.raises(PluginError, match="both or neither"):
        markov_kernel.markov_draft_triton(**feeds, **OPTIONS)
    with pytest.raises(PluginError, match="unknown inputs"):
        markov_kernel.run({**feeds, "bogus": feeds["hidden"]}, **OPTIONS)
    feeds = _tensors(markov_feeds(np.random.default_rng(0), "greedy", config))
    with pytest.raises(PluginError, match=r"'d2t'.*\[0, V=50\).*d2t\[1\] = 50"):
        markov_kernel.run({**feeds, "base_logits": feeds["base_logits"][..., :2].contiguous(),
                           "markov_w2": feeds["markov_w2"][:2].contiguous(), "d2t": torch.tensor([3, 50])}, **OPTIONS)


def test_gate_logs_once_and_registry_refuses_without_triton(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    assert triton_support.has_triton.__wrapped__() is False
    assert "cannot import triton" in caplog.text
    monkeypatch.setattr(triton_support, "has_triton", lambda: False)
    with pytest.raises(PluginError, match="dspark::MarkovDraft: the Triton kernel needs the triton package"):
        OP_REGISTRY["MarkovDraft"].triton({})


# --- ahead-of-time compilation ---

_PTX_SCRIPT = """
import json
from dspark_export.plugins.markov_draft.triton_kernel import ptx as markov_ptx
from dspark_export.plugins.speculative_verify.triton_kernel import ptx as verify_ptx
found = {}
for name, make_ptx in (("markov_draft_kernel", markov_ptx), ("speculative_verify_kernel", verify_ptx)):
    text = make_ptx(capability=90)
    found[name] = [line for line in text.splitlines() if line.startswith((".target", ".visible .entry"))]
print(json.dumps(found))
"""


@needs_triton
def test_kernels_compile_to_ptx_for_sm90_without_a_gpu(tmp_path):
    """A fresh process (no interpreter mode) compiles both kernels for sm_90 with the default blocks."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for name, lines in found.items():
        assert any(line.startswith(".target sm_90") for line in lines), (name, lines)
        assert f".visible .entry {name}(" in lines, (name, lines)
