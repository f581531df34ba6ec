"""Shared tools of the reliability tests: reference caches, byte-level detokenizers, scripted
policies and drafters, engine wrappers that record feeds or inject faults."""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

from dspark_export.engines.packing import Segment, pack_segments
from dspark_export.runtime.draft_control import DraftController
from dspark_export.runtime.kv_cache import KVCache
from ..runtime.self_draft import TargetDrafter


# -- invariants ------------------------------------------------------------------------------
def live_states(gen):
    return [s for s in gen.batch.slots if s is not None and not s.done]


def check_lengths(gen) -> None:
    """failure_cases.md note 5, after a step: for every decoding request, target KV valid length ==
    drafter context valid length == committed length - 1 (the last committed token, the anchor, is
    pending: it is the first row of the next verification), and the anchor's position == that length."""
    for s in live_states(gen):
        if not s.decoding:
            continue
        committed = len(s.prompt) + len(s.result.token_ids)
        assert gen.target_kv.lens[s.slot] == committed - 1 == s.start, (s.index, gen.target_kv.lens, committed)
        if gen.policy.drafts:   # drafter context = flushed rows + the backlog the next draft flushes first
            assert gen.draft_kv.lens[s.slot] + s.backlog_rows == committed - 1, \
                (s.index, gen.draft_kv.lens, s.backlog_rows, committed)
            assert s.backlog_rows < 2 * gen.backlog_limit
        else:
            assert not s.backlog and s.backlog_rows == 0
        assert s.anchor == s.result.token_ids[-1]


def fresh_caches(engines, ids: list[int]):
    """K/V of a fresh prefill of `ids` (one request, empty past), and the drafter context of its rows.

    Returns (target_keys, target_values, context_keys, context_values), each a list per layer of
    [kvH, n, D] float32, and the tapped features aux [n, F] float32.
    """
    spec = engines.manifest.data["graphs"]["target"]["spec"]
    cache = KVCache(spec["num_layers"], 1, spec["num_kv_heads"], spec["head_dim"], len(ids) + 1, len(ids) + 1)
    step = engines.buckets("target")[-1]
    aux = []
    for a in range(0, len(ids), step):
        chunk = np.asarray(ids[a:a + step], np.int64)
        runner = engines.runner("target", len(chunk))
        packed = pack_segments([Segment(0, chunk, a, "none")], 1, cache.lens, runner.key.bucket)
        out = runner.infer({**packed.feed, **cache.feed("past_key", "past_value")})
        L = cache.num_layers
        cache.append(np.zeros(len(chunk), np.int64), [out[f"new_key.{i}"] for i in range(L)],
                     [out[f"new_value.{i}"] for i in range(L)], np.arange(len(chunk)))
        aux.append(out["aux_hidden"][:len(chunk)])
    aux = np.concatenate(aux)
    n = len(ids)
    keys = [k[0, :, :n] for k in cache.keys]
    values = [v[0, :, :n] for v in cache.values]
    ctx_spec = engines.manifest.data["graphs"]["drafter_block"]["spec"]
    ck = [[] for _ in range(ctx_spec["num_layers"])]
    cv = [[] for _ in range(ctx_spec["num_layers"])]
    step = engines.buckets("drafter_context")[-1]
    for a in range(0, n, step):
        m = min(step, n - a)
        runner = engines.runner("drafter_context", m)
        b = runner.key.bucket
        feed_aux = np.zeros((b, aux.shape[1]), np.float32)
        feed_aux[:m] = aux[a:a + m]
        pos = np.zeros(b, np.int64)
        pos[:m] = np.arange(a, a + m)
        out = runner.infer({"aux_hidden": feed_aux, "position_ids": pos})
        for i in range(len(ck)):
            ck[i].append(out[f"context_key.{i}"][:m])
            cv[i].append(out[f"context_value.{i}"][:m])
    to_heads = (lambda x: np.concatenate(x).transpose(1, 0, 2))
    return keys, values, [to_heads(x) for x in ck], [to_heads(x) for x in cv], aux


def check_caches_equal_fresh(gen, atol: float = 1e-4) -> None:
    """The cached rows of every decoding request equal a fresh prefill of its committed sequence
    (minus the pending anchor): no stale, skipped or duplicated row, no row of a rejected draft. The
    drafter context holds the first rows, its backlog the rest (features and positions, in order)."""
    for s in live_states(gen):
        if not s.decoding:
            continue
        seq = list(s.prompt) + s.result.token_ids[:-1]
        n = len(seq)
        keys, values, ck, cv, aux = fresh_caches(gen.engines, seq)
        for layer in range(gen.target_kv.num_layers):
            np.testing.assert_allclose(gen.target_kv.keys[layer][s.slot, :, :n], keys[layer], atol=atol)
            np.testing.assert_allclose(gen.target_kv.values[layer][s.slot, :, :n], values[layer], atol=atol)
        if gen.policy.drafts:
            m = int(gen.draft_kv.lens[s.slot])
            for layer in range(gen.draft_kv.num_layers):
                np.testing.assert_allclose(gen.draft_kv.keys[layer][s.slot, :, :m], ck[layer][:, :m], atol=atol)
                np.testing.assert_allclose(gen.draft_kv.values[layer][s.slot, :, :m], cv[layer][:, :m], atol=atol)
            if s.backlog:
                np.testing.assert_array_equal(np.concatenate([p for _, p in s.backlog]), np.arange(m, n))
                np.testing.assert_allclose(np.concatenate([a for a, _ in s.backlog]), aux[m:n], atol=atol)
            else:
                assert m == n


# -- detokenizers ----------------------------------------------------------------------------
def byte_detokenizer(assign: dict[int, int]) -> Callable[[list[int]], str]:
    """A byte-level detokenizer over 256 ids: id → one byte (a bijection), bytes decoded as UTF-8 with
    replacement characters for incomplete sequences (as byte-level BPE decoders do). `assign` fixes
    chosen ids' bytes; the other ids get ASCII letters first, then the remaining bytes."""
    table = dict(assign)
    free = [b for b in list(range(ord("a"), ord("z") + 1)) + list(range(ord("A"), ord("Z") + 1)) + list(range(256))
            if b not in table.values()]
    seen = set()
    free = [b for b in free if not (b in seen or seen.add(b))]
    for i in range(256):
        if i not in table:
            table[i] = free.pop(0)
    lut = bytes(table[i] for i in range(256))
    return lambda ids: bytes(lut[i] for i in ids).decode("utf-8", errors="replace")


# -- scripted policies and drafters ------------------------------------------------------------
class ScriptedPolicy:
    """Verification lengths chosen by lengths(step number, number of requests R) — the scheduler
    forcing lengths (failure_cases.md SD-05, SD-20). Duck-types `runtime.policies.Policy`."""

    name, k, drafts, needs_profile = "scripted", 0, True, False

    def __init__(self, lengths: Callable[[int, int], int]):
        self.lengths, self.count = lengths, 0

    def draft_controller(self, profile, block_size) -> DraftController:
        return DraftController(self.drafts)          # drafts every step

    def verify_lengths(self, confidence, block_size, profile=None, lagged_confidence=None, max_lengths=None):
        n = self.lengths(self.count, confidence.shape[0])
        self.count += 1
        lens = np.full(confidence.shape[0], min(n, block_size), np.int64)
        return lens if max_lengths is None else np.minimum(lens, max_lengths)


class EditedDrafter:
    """The target drafting for itself (`TargetDrafter`), with drafts edited by `edit(step, state, ids)`
    → new ids [γ] (e.g. a wrong token at one position); draft logits become one-hot at the edited ids
    where they were changed (q is then exactly the distribution the edited draft came from)."""

    def __init__(self, edit: Callable, base: Callable | None = None):
        self.edit, self.base, self.step = edit, base or TargetDrafter(), 0

    def __call__(self, gen, active):
        out = self.base(gen, active)
        ids, logits = out["draft_ids"].copy(), out["draft_logits"].copy()
        for s in active:
            new = np.asarray(self.edit(self.step, s, ids[s.slot].copy()), np.int64)
            changed = new != ids[s.slot]
            logits[s.slot, changed] = -30.0
            logits[s.slot, np.flatnonzero(changed), new[changed]] = 30.0
            ids[s.slot] = new
        self.step += 1
        return {**out, "draft_ids": ids, "draft_logits": logits}


class RecordingRunner:
    """Wraps an engine runner: records (key, feed copy, names of inputs the call changed, outputs)."""

    def __init__(self, runner, log: list):
        self.runner, self.log, self.key = runner, log, runner.key

    def padded_rows(self, rows):
        return self.runner.padded_rows(rows)

    def infer(self, feed):
        snapshot = {k: np.array(v, copy=True) for k, v in feed.items()}
        out = self.runner.infer(feed)
        changed = [k for k in feed if not np.array_equal(feed[k], snapshot[k])]
        self.log.append((self.key, snapshot, changed, out))
        return out


def wrap_runners(monkeypatch, engines, graph: str, factory) -> None:
    """Route every `engines.runner(graph, n)` through factory(runner)."""
    original = type(engines).runner
    cache = {}

    def runner(self, g, size):
        r = original(self, g, size)
        if self is not engines or g != graph:
            return r
        if r.key not in cache:
            cache[r.key] = factory(r)
        return cache[r.key]

    monkeypatch.setattr(type(engines), "runner", runner)


# -- statistics -------------------------------------------------------------------------------
def chi_square_p(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Upper-tail p-value of Pearson's χ² goodness of fit (bins with expected count < 5 merged into
    one), through the Wilson–Hilferty normal approximation of the χ² distribution."""
    n = observed.sum()
    expected = expected_probs * n
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    if df <= 0:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))
