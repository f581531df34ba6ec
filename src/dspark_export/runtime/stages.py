"""The engine calls of one speculative step, each with its feeds and its output checks: drafter context,
drafter block, target pass, verify, and the rows a step commits.

Every method runs engines and reads the batch, but changes no request's state or valid cache length:
drafter-context rows are written past each slot's valid length, and `Generator._apply` makes a step's
results valid. Rows whose engine outputs fail a check (`faults`) are recorded in the round's `failed`
and leave the step. Dimension letters: S slots, γ draft block size, V vocab, n rows, F tapped features,
kvH KV heads, D head dim.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..engines.engine_set import EngineSet
from ..engines.packing import PackedBatch, Segment, pack_segments
from ..errors import EngineRunError
from ..plugins.markov_draft.schema import scatter_draft_logits
from . import faults
from .batch import Batch, RequestState
from .kv_cache import layer_names

__all__ = ["EngineStages", "Round", "Commit", "ContextWindow"]


@dataclass(frozen=True)
class ContextWindow:
    """Which committed rows a drafter-context flush writes: the first `sink` positions of the request and the
    `recent` positions just before its anchor; rows between are dropped unread. Rows flushed earlier stay in
    the drafter cache, so the drafter reads a subset of the positions before its anchor, each key at its true
    position (RoPE is applied at `position_ids`), and `context_lens` counts the entries, not the positions.

    Why: the drafter's context is the target features of every committed row, and a prompt's rows were most of
    what a flush ran (a request's first draft flushes its whole prompt; a dspark-async probe flushes every row
    committed since the request's last draft). The shipped drafter drafts as well from 4 + 32 rows as from the
    whole prompt (reports/runtime_split/s41/). Attention sinks plus a recent window: StreamingLLM (Xiao et al.,
    2023); MagicDec (Chen et al., 2024) drafts from such a cache. Drafts only decide how fast the output comes:
    output stays lossless.

    Manifest: ``runtime.drafter_context_window`` {"sink", "recent"} (`Manifest.drafter_context_window`); absent =
    every row (exact drafting).
    """

    sink: int
    recent: int

    def __post_init__(self):
        if self.sink < 0 or self.recent < 1:
            raise ValueError(f"ContextWindow: expected sink >= 0 and recent >= 1 rows, found sink {self.sink}, "
                             f"recent {self.recent}")

    def keep(self, positions: np.ndarray, anchor: int | np.ndarray) -> np.ndarray:
        """[n] bool: which rows at `positions` [n] int64 the drafter reads, for requests anchored at `anchor`
        (a position, or one per row [n] int64)."""
        return (positions < self.sink) | (positions >= anchor - self.recent)


@dataclass
class Commit:
    """Rows one step commits: slot of each row [n] int64 (a slot's rows in position order), the target's new
    K/V [2L, n, kvH, D] (every layer's keys, then values), and for the drafter-context backlog, per slot, its
    rows' tapped features [n_s, F] float32 (a view into the pass's `aux_hidden` when they are most of it, else a
    copy: `_backlog_rows`) and positions [n_s] int64 (None when the policy never drafts)."""

    slots: np.ndarray
    target_kv: np.ndarray
    backlog: dict[int, tuple[np.ndarray, np.ndarray]] | None = None


@dataclass
class Round:
    """One step's computed outcome, before it is committed (`Generator._apply`). Per-slot values are dense
    [S] arrays; `failed` maps the slots whose engine outputs failed a check to the reason."""

    active: list[RequestState]
    verify_lens: np.ndarray                       # [S] int64 drafts each slot verifies (0 elsewhere)
    decoding: list[RequestState] = field(default_factory=list)
    finishing: list[RequestState] = field(default_factory=list)  # requests whose prefill ends this step
    prefill: dict[int, int] = field(default_factory=dict)  # slot -> prompt tokens prefilled after this step
    drafts: dict | None = None
    drafted: list[RequestState] = field(default_factory=list)  # the requests the drafter block drafted for
    conf: np.ndarray | None = None                # [R', γ] confidences of the drafted requests
    failed: dict[int, str] = field(default_factory=dict)
    num_accepted: np.ndarray | None = None        # [S] int64
    next_ids: np.ndarray | None = None            # [S] int64
    commit: Commit | None = None
    flushed: dict[int, int] = field(default_factory=dict)  # slot -> drafter context length after the flush

    def live(self, states: list[RequestState]) -> list[RequestState]:
        """The requests of `states` no check has failed."""
        return [s for s in states if s.slot not in self.failed]


class EngineStages:
    """The engine calls of a step over a batch's slots.

    Args:
        engines: the loaded engines.
        batch: the slots and KV caches the calls read and write.
        block_size, vocab_size: γ and V.
        drafts: whether the policy drafts (then committed rows keep their features for the drafter context).
        sts: [γ] float32 the STS temperatures the drafter block divides its confidence logits by.
        confidence_bias: [γ] float64 per-position calibration bias b_k (`training.calibration`), applied to
            the drafter block's confidence: σ(logit(c) + b); all 0 for manifests without one.
        drafter: replaces the DSpark drafter block: drafter(generator, active states) → drafts (see
            `Generator`); `generator` is what it receives as its first argument.
    """

    def __init__(self, engines: EngineSet, batch: Batch, block_size: int, vocab_size: int, drafts: bool,
                 sts: np.ndarray, confidence_bias: np.ndarray, drafter: Callable | None = None, generator=None):
        self.engines, self.batch = engines, batch
        self.block_size, self.vocab_size, self.drafts = block_size, vocab_size, drafts
        self.sts, self.confidence_bias = sts, confidence_bias
        self.drafter, self.generator = drafter, generator
        self.max_tokens = engines.buckets("target")[-1]
        self.ragged_target = engines.ragged_attention("target")   # one pass per step, no query-width cache room
        self.last_key: dict[str, str] = {}   # graph -> path of the engine last called (for messages)
        self._zeros: np.ndarray | None = None
        vocab = engines.manifest.data.get("draft_vocab")
        # the block's draft_logits columns: ascending d2t, as the exporter orders it (ARCHITECTURE.md)
        self.d2t = np.sort(np.asarray(vocab["d2t"], np.int64)) if vocab else None
        # the rows a flush writes (None: every committed row)
        window = engines.manifest.drafter_context_window
        self.context_window = ContextWindow(*window) if window else None

    def infer(self, runner, feed: dict) -> dict[str, np.ndarray]:
        """runner.infer, turning any failure into EngineRunError naming the engine."""
        self.last_key[runner.key.graph] = runner.key.path
        try:
            return runner.infer(feed)
        except Exception as e:  # ORT raises its own Fail/RuntimeException/... types
            raise EngineRunError(f"engine {runner.key.path} failed ({type(e).__name__}: {e})") from e

    def _engine(self, graph: str) -> str:
        return self.last_key.get(graph, graph)

    # -- drafter ---------------------------------------------------------------------------------
    def flush_context(self, rnd: Round, states: list[RequestState]) -> dict[int, int]:
        """Run the backlog of `states` through the drafter context engine and write the K/V rows into the
        drafter cache PAST each slot's valid length (`KVCache.write_stacked`); `_apply` makes them valid. A failed
        step therefore leaves the cache as it was. Slots whose context rows come back non-finite fail. With a
        `context_window`, only the rows it keeps run; the rest of the backlog is dropped with it.

        Returns:
            {slot: drafter context length once the step commits} for the flushed slots that did not fail
            (the `context_lens` the drafter block reads this step).
        """
        if not states:
            return {}
        aux = np.concatenate([a for s in states for a, _ in s.backlog])
        positions = np.concatenate([p for s in states for _, p in s.backlog])
        slots = np.concatenate([np.full(s.backlog_rows, s.slot, np.int64) for s in states])
        if self.context_window is not None:
            anchors = np.concatenate([np.full(s.backlog_rows, s.start, np.int64) for s in states])
            kept = self.context_window.keep(positions, anchors)
            aux, positions, slots = aux[kept], positions[kept], slots[kept]
        draft_kv = self.batch.draft_kv
        if len(positions):
            keys, values = self.context_rows(aux, positions)
            rnd.failed.update(faults.check_rows(slots, keys + values, self._engine("drafter_context")))
            good = ~np.isin(slots, np.array(sorted(rnd.failed), np.int64))
            draft_kv.write_stacked(slots[good], np.stack(keys + values), rows=np.flatnonzero(good))
        rows = np.bincount(slots, minlength=self.batch.num_slots)
        return {s.slot: int(draft_kv.lens[s.slot] + rows[s.slot]) for s in states if s.slot not in rnd.failed}

    def context_rows(self, aux: np.ndarray, positions: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Drafter context K/V [n, kvH, D] per drafter layer for committed rows aux [n, F] at `positions`."""
        step = self.engines.buckets("drafter_context")[-1]
        L = self.batch.draft_kv.num_layers
        keys, values = [[] for _ in range(L)], [[] for _ in range(L)]
        for a in range(0, len(aux), step):
            n = min(step, len(aux) - a)
            runner = self.engines.runner("drafter_context", n)
            b = runner.padded_rows(n)
            feed_aux = np.zeros((b, aux.shape[1]), np.float32)
            feed_aux[:n] = aux[a:a + n]
            feed_pos = np.zeros(b, np.int64)
            feed_pos[:n] = positions[a:a + n]
            out = self.infer(runner, {"aux_hidden": feed_aux, "position_ids": feed_pos})
            for i in range(L):
                keys[i].append(out[f"context_key.{i}"][:n])
                values[i].append(out[f"context_value.{i}"][:n])
        return [np.concatenate(k) for k in keys], [np.concatenate(v) for v in values]

    def propose(self, rnd: Round, decoding: list[RequestState], every: bool = True) -> tuple[dict, float]:
        """`draft` for the requests `decoding`, its wall time in s, and the check of its outputs."""
        t0 = time.perf_counter()
        drafts = self.draft(decoding, rnd.flushed, every)
        seconds = time.perf_counter() - t0
        rnd.failed.update(faults.check_drafts(drafts, decoding, self.vocab_size, self._engine("drafter_block")))
        return drafts, seconds

    def draft(self, active: list[RequestState], flushed: dict[int, int], every: bool = True) -> dict[str, np.ndarray]:
        """Drafts for every slot: {"draft_ids" [S, γ] int64, "draft_logits" [S, γ, Vd] float32 (over d2t with a
        draft vocabulary), "confidence" [S, γ] float32}; rows of slots not in `active` are ignored (and 0 when
        not `every`). `flushed`: the drafter context lengths this step's flush reaches (`flush_context`); every
        active request's backlog has been flushed, so its context covers every position before its anchor.
        `every`: one block over every slot, reading the drafter cache in place; else a block of the smallest
        bucket that holds the active requests' rows alone, their drafter cache rows copied out (`KVCache.gather`)
        and the outputs scattered back to [S, ...]. A request drafts as in the block over every slot, up to
        float rounding (drafts only decide how fast the output comes)."""
        if self.drafter is not None:
            return self.drafter(self.generator, active)
        S, slots = self.batch.num_slots, np.array([s.slot for s in active], np.int64)
        runner = self.engines.runner("drafter_block", S if every else len(slots))
        rows = S if every else runner.padded_rows(len(slots))
        at = slots if every else np.arange(len(slots))     # each request's row in the block
        anchors, starts, context_lens = (np.zeros(rows, np.int64) for _ in range(3))
        uniforms = np.zeros((rows, self.block_size), np.float32)
        for r, s in zip(at, active):
            anchors[r], starts[r] = s.anchor, s.start
            context_lens[r] = flushed.get(s.slot, int(self.batch.draft_kv.lens[s.slot]))
            uniforms[r] = s.rng.random(self.block_size, dtype=np.float32)
        # padding rows (context 0) repeat the first request's sampling values: their outputs are dropped
        take = np.arange(S) if every else np.concatenate([slots, np.full(rows - len(slots), slots[0])])
        kv = self.batch.draft_kv
        feed = {"anchor_ids": anchors, "start_positions": starts, "context_lens": context_lens,
                **(kv.feed("context_key", "context_value") if every else
                   kv.gather("context_key", "context_value", slots, rows, int(context_lens.max()))),
                **{name: value[take] for name, value in self.batch.sampling(active).items()},
                "uniforms": uniforms, "confidence_temperature": self.sts}
        out = self.calibrated(self.infer(runner, feed))
        if every:
            return out
        full = {}   # back to [S, ...], 0 for every slot not drafted for
        for name in ("draft_ids", "draft_logits", "confidence"):
            full[name] = np.zeros((S,) + out[name].shape[1:], out[name].dtype)
            full[name][slots] = out[name][:len(slots)]
        return full

    def calibrated(self, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The drafter block's outputs with the manifest's per-position confidence bias applied."""
        if self.confidence_bias.any():
            c = np.clip(np.asarray(out["confidence"], np.float64), 1e-7, 1 - 1e-7)   # NaN stays NaN (fault check)
            z = np.log(c) - np.log1p(-c) + self.confidence_bias
            out = {**out, "confidence": (1.0 / (1.0 + np.exp(-z))).astype(np.float32)}
        return out

    # -- target ----------------------------------------------------------------------------------
    def target_pass(self, rnd: Round, segments: list[Segment]
                    ) -> tuple[PackedBatch, dict[str, np.ndarray], np.ndarray]:
        """Run the step's segments through the target (`split_passes`); slots with non-finite rows fail. Also
        returns the new K/V outputs stacked once, [2L, N, kvH, D] (every layer's keys, then values), which the
        check and the commit both read."""
        packed, out = self.split_passes(segments)
        L = self.batch.target_kv.num_layers
        kv = np.stack([out[name] for name in layer_names("new_key", L) + layer_names("new_value", L)])
        rnd.failed.update(faults.check_target(packed, out, kv, segments, self._engine("target")))
        return packed, out, kv

    def split_passes(self, segments: list[Segment]) -> tuple[PackedBatch, dict[str, np.ndarray]]:
        """Run the step's segments through the target; returns (where each slot's rows and logits landed,
        the outputs), as one packed pass would.

        With a ragged attention kernel (`EngineSet.ragged_attention`) every segment shares one pass: the
        kernel reads each request's own rows and live cache entries, so a prefill chunk beside decode rows
        costs its rows only, and a second pass would read the weights again (reports/runtime_split/s38).

        Otherwise, when at most max(1, S // 4) segments are longer than a verification block (prefill chunks), each of
        them runs in a pass of its own over its slot alone and the rest share one pass. That slot's cache is
        trimmed to its valid entries plus the chunk, rounded up to KEY_CHUNK (`KVCache.feed(slot=...)`, a copy
        of one slot), because attention runs over every entry of the buffer. Why split: the graph's attention pads every
        slot's query to the longest one ([S, Q], `pad_index`), so a long chunk next to S decode rows costs
        S × its length query rows of attention over the whole cache. Each split costs one more weight read
        of the target, so when many slots prefill together (most of the S rows are long anyway) they stay
        in one pass (reports/measurement_history.md, "split target passes"). Each slot's rows are reported
        with the engine that computed them (`PackedBatch.engines`).
        """
        kv = self.batch.target_kv
        for seg in segments:
            kv.reserve(int(kv.lens[seg.slot]) + len(seg.token_ids))
        if self.ragged_target:
            return self.target_run(segments, None)
        long = [len(seg.token_ids) > self.block_size + 1 for seg in segments]
        split = sum(long) <= max(1, self.batch.num_slots // 4)
        alone = [seg for seg, is_long in zip(segments, long) if split and is_long]
        shared = [seg for seg, is_long in zip(segments, long) if not (split and is_long)]
        passes = [self.target_run(shared, None)] if shared else []
        passes += [self.target_run([seg], seg.slot) for seg in alone]
        if len(passes) == 1:
            return passes[0]
        row_start, logit_start, engines, outs, rows, logits = {}, {}, {}, [], 0, 0
        for packed, out in passes:
            row_start.update({slot: a + rows for slot, a in packed.row_start.items()})
            logit_start.update({slot: a + logits for slot, a in packed.logit_start.items()})
            engines.update(packed.engines)
            rows, logits = rows + out["aux_hidden"].shape[0], logits + out["logits"].shape[0]
            outs.append(out)
        merged = {name: np.concatenate([out[name] for out in outs]) for name in outs[0]}
        return PackedBatch({}, row_start, logit_start, sum(p.num_real_tokens for p, _ in passes),
                           engines=engines), merged

    def target_run(self, segments: list[Segment], slot: int | None) -> tuple[PackedBatch, dict[str, np.ndarray]]:
        """One target pass: over every slot of the cache (slot None), or over `slot` alone (one segment; the
        pass sees that slot's cache trimmed to its valid entries, [1, kvH, P, D], and its rows are reported
        under `slot`)."""
        rows = sum(len(seg.token_ids) for seg in segments)
        runner = self.engines.runner("target", rows)
        kv = self.batch.target_kv
        if slot is None:
            packed = pack_segments(segments, self.batch.num_slots, kv.lens, runner.padded_rows(rows))
            packed.engines = {seg.slot: str(runner.key.path) for seg in segments}
            # the ONNX-op attention writes new keys into the buffer at lens + j: room for the padded query width
            width = 0 if self.ragged_target else packed.feed["pad_index"].shape[1]
            return packed, self.infer(runner, {**packed.feed, **kv.feed("past_key", "past_value", width=width)})
        seg = segments[0]
        packed = pack_segments([Segment(0, seg.token_ids, seg.start_position, seg.logits)], 1,
                               kv.lens[slot:slot + 1], runner.padded_rows(rows))
        width = packed.feed["pad_index"].shape[1]
        out = self.infer(runner, {**packed.feed, **kv.feed("past_key", "past_value", slot, width=width)})
        return PackedBatch({}, {slot: packed.row_start[0]},
                           {slot: packed.logit_start[0]} if 0 in packed.logit_start else {},
                           packed.num_real_tokens, engines={slot: str(runner.key.path)}), out

    # -- verify and commit -----------------------------------------------------------------------
    def verify(self, rnd: Round, states: list[RequestState], rows: dict[int, np.ndarray]):
        """SpeculativeVerify over all slots (slots without rows get one inert zero row): [S] accepted drafts
        and [S] next token ids; slots whose values are out of range fail.

        A step whose requests are all greedy (every `ar` step, and most dspark steps) runs the op's greedy rule
        in numpy (`greedy_verify`) instead of an engine call (ORT's per-call cost is ~0.3 ms on a ~10 ms
        one-token step) and never reads `draft_logits`. The uniforms are drawn either way, so each request's
        random stream does not depend on which path ran."""
        S, V, g = self.batch.num_slots, self.vocab_size, self.block_size
        lens = np.array([rnd.verify_lens[slot] if slot in rows else 0 for slot in range(S)], np.int64)
        uniforms = np.zeros((S, g + 1), np.float32)
        for s in states:
            uniforms[s.slot] = s.rng.random(g + 1, dtype=np.float32)
        sampling = self.batch.sampling(states)
        drafts, sampled = rnd.drafts, np.flatnonzero(sampling["temperature"] > 0)
        if not sampled.size:   # greedy: q (draft_logits) is never read
            draft_ids = drafts["draft_ids"] if drafts else np.zeros((S, g), np.int64)
            num_accepted, next_ids = greedy_verify(rows, draft_ids, lens, V)
            rnd.failed.update(faults.check_verify(num_accepted, next_ids, rnd.verify_lens, states, V,
                                                  self._engine("target")))   # a logits row wider than V
            return num_accepted, next_ids
        blocks = [rows.get(slot, np.zeros((1, V), np.float32)) for slot in range(S)]
        draft_logits = self.full_draft_logits(drafts["draft_logits"], sampled) if drafts else self._zero_draft_logits()
        if drafts and rnd.failed:   # a failed slot's (maybe NaN) drafts must not reach the op at all
            draft_logits = draft_logits.copy() if draft_logits is drafts["draft_logits"] else draft_logits
            draft_logits[sorted(rnd.failed)] = 0.0
        feed = {"target_logits": np.concatenate(blocks).astype(np.float32, copy=False),
                "query_start": np.concatenate([[0], np.cumsum(lens + 1)]).astype(np.int64),
                "draft_ids": np.clip(drafts["draft_ids"], 0, V - 1) if drafts else np.zeros((S, g), np.int64),
                "draft_logits": draft_logits,
                "verify_lens": lens, **sampling, "uniforms": uniforms}
        out = self.infer(self.engines.runner("verify", S), feed)
        rnd.failed.update(faults.check_verify(out["num_accepted"], out["next_ids"], rnd.verify_lens, states,
                                              V, self._engine("verify")))
        return out["num_accepted"], out["next_ids"]

    def full_draft_logits(self, draft_logits: np.ndarray, slots: np.ndarray | None = None) -> np.ndarray:
        """[S, γ, Vd] draft logits -> [S, γ, V], the verify op's q: scattered at d2t (`scatter_draft_logits`)
        when the block returns them over the draft vocabulary, else as they are. `slots`: the slots whose q the
        op reads (its sampled requests; a greedy row's verification never reads q), the others left 0 (as the
        no-draft feed); None = every slot."""
        width = draft_logits.shape[-1]
        if width == self.vocab_size:
            return draft_logits
        if self.d2t is None or len(self.d2t) != width:
            raise EngineRunError(f"engine {self._engine('drafter_block')} returned draft_logits {width} wide; expected "
                                 f"V = {self.vocab_size} or the manifest's draft_vocab size "
                                 f"({'none' if self.d2t is None else len(self.d2t)})")
        if slots is None or len(slots) == len(draft_logits):
            return scatter_draft_logits(draft_logits, self.d2t, self.vocab_size)
        full = np.zeros(draft_logits.shape[:-1] + (self.vocab_size,), np.float32)
        full[slots] = scatter_draft_logits(draft_logits[slots], self.d2t, self.vocab_size)
        return full

    def _zero_draft_logits(self) -> np.ndarray:
        S = self.batch.num_slots
        if self._zeros is None or self._zeros.shape[0] != S:
            self._zeros = np.zeros((S, self.block_size, self.vocab_size), np.float32)
        return self._zeros

    def commit_rows(self, packed: PackedBatch, out: dict, kv: np.ndarray, keep: dict[int, int]) -> Commit:
        """The first keep[slot] rows of each slot's segment: their target K/V (rows of `kv`, `target_pass`'s
        stacked [2L, N, kvH, D]), and (when the policy drafts)
        their tapped features and positions for the drafter-context backlog (features of committed rows
        only; DeepSpec spec §5.2 pitfall 2)."""
        order = sorted(keep.items())
        slots = np.concatenate([np.full(n, slot, np.int64) for slot, n in order])
        if len(order) == 1:   # one slot's rows are contiguous: views, not copies (the cache copies them)
            a = packed.row_start[order[0][0]]
            rows = slice(a, a + order[0][1])
        else:
            rows = np.concatenate([packed.row_start[slot] + np.arange(n) for slot, n in order])
        c = Commit(slots, kv[:, rows])
        if self.drafts:
            lens, aux = self.batch.target_kv.lens, out["aux_hidden"]
            c.backlog = {slot: (_backlog_rows(aux, packed.row_start[slot], n),
                                np.arange(lens[slot], lens[slot] + n, dtype=np.int64)) for slot, n in order}
        return c


def _backlog_rows(aux: np.ndarray, start: int, n: int) -> np.ndarray:
    """Rows start..start+n-1 of a pass's aux_hidden [N, F] for a backlog: a view when they are at least half of
    the pass (a prefill chunk: no copy of a large block), else a copy, so a decoding request's backlog never
    holds a whole pass alive for its few rows (at 16 slots, a step with a 256-row prefill beside it would pin
    3 MB per step)."""
    rows = aux[start:start + n]
    return rows if 2 * n >= len(aux) else rows.copy()


def greedy_verify(rows: dict[int, np.ndarray], draft_ids: np.ndarray, verify_lens: np.ndarray,
                  vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`dspark::SpeculativeVerify` for an all-greedy batch, in numpy: ([S] num_accepted, [S] next_ids).

    rows[slot]: the slot's target logits [verify_lens[slot] + 1, V']; draft_ids [S, γ] int64 (clipped to
    [0, V) as the engine path feeds them). Draft j is accepted iff it equals the argmax of row j (first
    maximum on ties: ArgMax's and the op's choice); next_ids[slot] is the argmax of the row after the
    accepted run. Slots not in `rows` get (0, 0). Source: ARCHITECTURE.md, "dspark::SpeculativeVerify"."""
    S = len(verify_lens)
    num_accepted, next_ids = np.zeros(S, np.int64), np.zeros(S, np.int64)
    for slot, block in rows.items():
        best = block.argmax(axis=1)
        n = int(verify_lens[slot])
        match = best[:n] == np.clip(draft_ids[slot, :n], 0, vocab_size - 1)
        a = n if match.all() else int(np.argmin(match))
        num_accepted[slot], next_ids[slot] = a, best[a]
    return num_accepted, next_ids
