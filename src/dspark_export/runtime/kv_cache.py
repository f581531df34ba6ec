"""Slot-based KV caches for the target and the drafter context, held host-side in numpy.

Layout per layer: keys and values [S, kvH, C, D] float32 (S slots, C capacity). The engines read
the whole buffer (zero-copy into ONNX Runtime) and mask entries ≥ `lens[slot]`, so a step writes
only its new rows: `append` is O(rows), never O(context). C is always a multiple of KEY_CHUNK with room
for the pass's query width past the longest slot (`feed(width=...)`): the quantized target's exact
attention reads the cache in place in chunks of KEY_CHUNK keys (`exporter.target._exact_attention`).
Capacity grows to the next multiple of KEY_CHUNK that holds what a step needs (one O(cache) copy per
KEY_CHUNK tokens of the longest slot, so attention reads little past the live context) and, when
requests leave (`shrink`), halves back while the longest live slot fills at most a quarter of it.

Every layer's keys and values are views into one flat arena that a cache keeps for its life, and a
change of layout (growth, `shrink`, `remap`) moves the entries inside it instead of allocating anew:
writing fresh pages costs about 40x writing pages already touched on these VMs (first touch
~190 MB/s; reports/serve/kv-arena), and at 16 slots one layout is ~0.5 GB. The arena only grows, so a
cache holds the most it ever laid out; a `KVArenaPool` (one per EngineSet) hands a dead cache's arena to
the next one of its shape (a new Generator on the same engines). So a layer view is valid while its cache
lives: one kept past the cache's death reads whatever the arena's next cache writes.
"""

from __future__ import annotations

import functools
import queue
import threading
import weakref

import numpy as np

from ..exporter.quantize import aligned

__all__ = ["KVCache", "KVArenaPool", "layer_names", "check_count"]


class KVArenaPool:
    """Flat float32 arenas of dead caches, kept for the next caches: one per cache shape (layers, kvH, D), the
    largest given.

    A cache gives its arena back from a finalizer, which may run on any thread and inside a garbage collection
    that another pool call's allocation started: `give` only puts it on a `queue.SimpleQueue` (reentrant, made
    for finalizers), and `take` sorts the given arenas in under the lock."""

    def __init__(self):
        self._given: queue.SimpleQueue = queue.SimpleQueue()
        self._free: dict[tuple, np.ndarray] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple) -> np.ndarray | None:
        """The kept arena of caches of `shape` (removed from the pool), or None."""
        with self._lock:
            self._sort_in()
            return self._free.pop(shape, None)

    def give(self, shape: tuple, arena: np.ndarray) -> None:
        self._given.put((shape, arena))

    @property
    def held_bytes(self) -> int:
        with self._lock:
            self._sort_in()
            return sum(a.nbytes for a in self._free.values())

    def _sort_in(self) -> None:
        while True:
            try:
                shape, arena = self._given.get_nowait()
            except queue.Empty:
                return
            kept = self._free.get(shape)
            if kept is None or arena.size > kept.size:
                self._free[shape] = arena


@functools.cache
def layer_names(prefix: str, num_layers: int) -> tuple[str, ...]:
    """Per-layer engine input/output names f"{prefix}.{l}", l = 0..L-1 (built once: a step uses them 2L times)."""
    return tuple(f"{prefix}.{layer}" for layer in range(num_layers))


def check_count(name: str, value) -> int:
    """`value` as an int; ValueError naming `name` unless it is an integer ≥ 0 (bool refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, found {value!r}")
    return int(value)


def _give_back(pool: KVArenaPool, shape: tuple, holder: list) -> None:
    pool.give(shape, holder[0])


class KVCache:
    """Per-slot key/value cache.

    Args:
        num_layers (int): L.
        num_slots (int): S, the request slots of the batch.
        num_kv_heads (int): kvH.
        head_dim (int): D.
        max_capacity (int): the most entries one slot may hold (the engine's context capacity); the buffer
            may be longer (rounded up, plus a pass's query width).
        initial_capacity (int): starting C (rounded up to KEY_CHUNK). Defaults to 256.
        pool (KVArenaPool | None): where the arena comes from and goes back to when the cache dies.
    Raises (`remap`): ValueError for moves that do not increase in both slots.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 max_capacity: int, initial_capacity: int = 256, pool: KVArenaPool | None = None):
        self.num_layers, self.num_slots = num_layers, num_slots
        self.num_kv_heads, self.head_dim, self.max_capacity = num_kv_heads, head_dim, max_capacity
        self.initial_capacity = aligned(min(initial_capacity, max_capacity))
        self.lens = np.zeros(num_slots, np.int64)
        self.capacity = 0
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        shape = (num_layers, num_kv_heads, head_dim)
        arena = pool.take(shape) if pool is not None else None
        self._holder = [arena if arena is not None else np.zeros(0, np.float32)]   # [arena], for the finalizer
        if pool is not None:
            weakref.finalize(self, _give_back, pool, shape, self._holder)
        self._relayout(num_slots, self.initial_capacity, [])

    @property
    def arena_bytes(self) -> int:
        """Bytes of the arena the layers' views live in (touched or not)."""
        return self._holder[0].nbytes

    def _allocate(self, capacity: int) -> None:
        """Lay every layer out at `capacity`, keeping the first min(old, new) entries of each slot."""
        kept = min(self.capacity, capacity)
        self._relayout(self.num_slots, capacity, [(s, s, kept) for s in range(self.num_slots)])

    def _relayout(self, num_slots: int, capacity: int, moves: list[tuple[int, int, int]]) -> None:
        """Lay the cache out as [2, L, num_slots, kvH, capacity, D] in the arena; `moves` (old slot, new slot,
        entries), increasing in both slots, say which of each slot's leading entries to carry over. Every
        other entry of the new layout is zero (masked entries must be finite: the mask is an additive bias).

        In place when the arena holds the new layout: each (layer, slot, head) row is one copy, those moving
        toward the arena's start in ascending order, then those moving toward its end in descending order;
        with sources and destinations both in increasing order, no copy overwrites a source still to be read.
        Otherwise into a new arena of at least twice the size (untouched pages cost nothing until written)."""
        L2, H, D = 2 * self.num_layers, self.num_kv_heads, self.head_dim
        old, old_c, old_s = self._holder[0], self.capacity, self.num_slots
        if not all(a[0] < b[0] and a[1] < b[1] for a, b in zip(moves, moves[1:])):
            raise ValueError(f"KV cache relayout: moves (old slot, new slot, entries) must increase in both slots, "
                             f"found {moves}")
        if not all(0 <= o < old_s and 0 <= n < num_slots and 0 <= e <= min(old_c, capacity) for o, n, e in moves):
            raise ValueError(f"KV cache relayout: moves (old slot, new slot, entries) must lie within {old_s} → "
                             f"{num_slots} slots and min({old_c}, {capacity}) entries, found {moves}")
        needed = self._floats(num_slots, capacity)
        fresh = needed > old.size
        arena = np.zeros(max(needed, 2 * old.size), np.float32) if fresh else old
        rows = [(((l * old_s + o) * H + h) * old_c * D, ((l * num_slots + n) * H + h) * capacity * D, e * D)
                for l in range(L2) for o, n, e in moves if e for h in range(H)]
        if fresh:
            for src, dst, size in rows:
                arena[dst:dst + size] = old[src:src + size]
        else:
            left = [r for r in rows if r[1] < r[0]]
            right = [r for r in rows if r[1] > r[0]]
            for src, dst, size in left + right[::-1]:
                arena[dst:dst + size] = arena[src:src + size]
            view = arena[:needed].reshape(L2, num_slots, H, capacity, D)
            kept = np.zeros(num_slots, np.int64)
            for _, n, e in moves:
                kept[n] = e
            for n in range(num_slots):             # zero what no move wrote
                view[:, n, :, kept[n]:] = 0.0
        self._bind(arena, (2, self.num_layers, num_slots, H, capacity, D))
        self.capacity, self.num_slots = capacity, num_slots

    def _floats(self, num_slots: int, capacity: int) -> int:
        """Floats of the layout [2, L, num_slots, kvH, capacity, D]."""
        return 2 * self.num_layers * num_slots * self.num_kv_heads * capacity * self.head_dim

    def _bind(self, arena: np.ndarray, shape: tuple) -> None:
        """Make `arena` the cache's arena and its first prod(shape) floats the layout [2, L, S, kvH, C, D] that
        `keys` and `values` (per layer) view."""
        self._holder[0] = arena
        self._view = arena[:int(np.prod(shape))].reshape(shape)
        self.keys = [self._view[0, layer] for layer in range(self.num_layers)]
        self.values = [self._view[1, layer] for layer in range(self.num_layers)]

    def prefault(self, num_slots: int, entries: int) -> None:
        """Make the arena hold a layout of `num_slots` slots × `entries` entries (rounded up to KEY_CHUNK, at most
        max_capacity) and write every page of it once; the layout and its contents stay as they are.

        Why: a layout that outgrows the arena moves into fresh pages, and first touch runs ~40x slower than a
        write to touched pages on these VMs (module docstring): a step that grows the cache stalls for up to
        ~0.7 s at 4 slots. A benchmark's warm-up calls this so that no measured step pays it; a server could
        at startup, as vLLM allocates its KV cache up front.

        Raises:
            ValueError: `num_slots` or `entries` is not an integer ≥ 0."""
        num_slots = check_count("KV cache prefault: num_slots", num_slots)
        entries = check_count("KV cache prefault: entries", entries)
        need = self._floats(num_slots, aligned(min(entries, self.max_capacity)))
        arena, used = self._holder[0], self._view.size
        if need > arena.size:
            grown = np.empty(need, np.float32)
            grown[:used] = arena[:used]
            self._bind(grown, self._view.shape)
            arena = grown
        else:           # the layout may sit on pages never written (a fresh arena is calloc'ed): one write a page
            page = 4096 // arena.itemsize
            arena[:used:page] = arena[:used:page]
        arena[used:] = 0.0      # past the layout: scratch that `_relayout` zeroes before use

    def reserve(self, needed: int) -> None:
        """Make room for `needed` entries in some slot. Raises ValueError past max_capacity."""
        if needed > self.max_capacity:
            raise ValueError(f"KV cache: {needed} entries exceed the capacity {self.max_capacity}")
        self._grow(needed)

    def _grow(self, entries: int) -> None:
        if entries > self.capacity:
            self._allocate(aligned(entries))

    def attended(self, width: int) -> int:
        """P, the buffer length `feed(width=width)` hands the engines (key entries a pass attends per slot)."""
        return max(self.capacity, aligned(int(self.lens.max(initial=0)) + width))

    def shrink(self) -> bool:
        """Halve the capacity while the longest live slot fills at most a quarter of it (the last halving
        stops at the initial capacity); returns whether it reallocated (one O(cache) copy).

        Why: every engine attends over the whole buffer, so without this one long request would leave
        every later step reading its capacity for good (reports/measurement_history.md, "KV shrink";
        `scripts/bench_kv_shrink.py` measures it). The quarter (not half) keeps a slot
        that hovers at a boundary from reallocating on every request: after a shrink the longest slot
        fills at most half the buffer, so it must double before the next growth.
        """
        live = int(self.lens.max()) if self.num_slots else 0
        capacity = self.capacity
        while capacity > self.initial_capacity and 4 * live <= capacity:
            capacity = max(self.initial_capacity, aligned(capacity // 2))
        if capacity == self.capacity:
            return False
        self._allocate(capacity)
        return True

    def append(self, slots: np.ndarray, new_keys: list[np.ndarray], new_values: list[np.ndarray],
               rows: np.ndarray | None = None) -> None:
        """Write new entries at the end of their slots, in order, and make them valid.

        Args:
            slots: [n] int64, the slot of each new entry (a slot's entries appear in position order).
            new_keys, new_values: per layer [N, kvH, D] float32 (an engine's packed output).
            rows: [n] int64, which of the N rows to write; defaults to all rows (n == N).
        """
        self.lens += self.write(slots, new_keys, new_values, rows)

    def append_stacked(self, slots: np.ndarray, kv: np.ndarray) -> None:
        """`append` from one array kv [2L, n, kvH, D]: every layer's keys, then every layer's values (the
        target pass's outputs as `EngineStages.target_pass` stacks them once per step)."""
        self.lens += self.write_stacked(slots, kv)

    def write(self, slots: np.ndarray, new_keys: list[np.ndarray], new_values: list[np.ndarray],
              rows: np.ndarray | None = None) -> np.ndarray:
        """Like `append`, but leave `lens` as it is: the entries sit past each slot's valid length, where
        every engine masks them, until the caller raises `lens` (a step that may still fail writes
        this way). Returns the entries written per slot, [S] int64."""
        return self.write_stacked(slots, np.stack(list(new_keys) + list(new_values)), rows)

    def write_stacked(self, slots: np.ndarray, kv: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """`write` from kv [2L, N, kvH, D] (as `append_stacked`), in one assignment rather than 2L: a step's
        host time is mostly numpy call overhead."""
        slots = np.asarray(slots, np.int64)
        if slots.size == 0:
            return np.zeros(self.num_slots, np.int64)
        counts = np.bincount(slots, minlength=self.num_slots)
        new = kv.reshape((2, self.num_layers) + kv.shape[1:])                 # [2, L, N, kvH, D]
        if rows is not None:
            new = new[:, :, rows]
        if counts[slots[0]] == slots.size:   # one slot (a single user's step): a plain slice, no fancy indexing
            first = int(self.lens[slots[0]])
            end = first + slots.size
            self.reserve(end)
            self._view[:, :, int(slots[0]), :, first:end] = new.transpose(0, 1, 3, 2, 4)   # [2, L, kvH, n, D]
        else:   # entry i of slot s goes to lens[s] + (its rank among slot s's entries)
            order = np.argsort(slots, kind="stable")
            rank = np.empty_like(slots)
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
            rank[order] = np.arange(slots.size) - np.repeat(starts, counts)
            positions = self.lens[slots] + rank
            self.reserve(int(positions.max()) + 1)
            self._view[:, :, slots, :, positions] = new.transpose(2, 0, 1, 3, 4)            # [n, 2, L, kvH, D]
        return counts

    def reset(self, slot: int) -> None:
        self.lens[slot] = 0

    def remap(self, num_slots: int, moves: dict[int, int]) -> None:
        """Change the slot count to `num_slots`, moving slot `old` to `new` for each (old, new) in `moves`
        (increasing in both: the batch compacts its live requests in order); every other slot of the
        result is empty. O(cache) moves in the arena: done only when the batch crosses a bucket boundary,
        not per step."""
        kept = [(o, n, int(self.lens[o]) if 0 <= o < self.num_slots else 0) for o, n in sorted(moves.items())]
        self._relayout(num_slots, self.capacity, kept)     # checks the moves first
        self.lens = np.zeros(num_slots, np.int64)
        for _, n, e in kept:
            self.lens[n] = e

    def feed(self, key_name: str, value_name: str, slot: int | None = None, width: int = 0) -> dict[str, np.ndarray]:
        """{f"{key_name}.{l}": keys [S,kvH,C,D], f"{value_name}.{l}": values} for an engine feed, after growing
        C to hold `width` entries (the pass's padded query width Q) past the longest slot: the ONNX exact
        attention's contract max_r lens[r] + Q ≤ C (it scatters new keys at lens[r] + j); a RaggedAttention
        target reads its new keys from the pass and feeds width 0.

        With `slot`, that slot's first P = aligned(lens[slot] + width) entries only, as [1,kvH,P,D]
        contiguous copies: the engines attend over every entry of the buffer (masking those ≥ lens), so a
        long query block (a prefill chunk) costs less over a trimmed cache than over the whole capacity, and
        the copy costs far less than it saves (reports/measurement_history.md, "trimmed KV feed")."""
        if slot is not None:
            needed = int(self.lens[slot]) + width
            self._grow(needed)
            return self.gather(key_name, value_name, [slot], 1, needed)
        self._grow(int(self.lens.max(initial=0)) + width)
        return dict(zip(layer_names(key_name, self.num_layers), self.keys)) | \
            dict(zip(layer_names(value_name, self.num_layers), self.values))

    def gather(self, key_name: str, value_name: str, slots: list[int], rows: int, entries: int) -> dict[str, np.ndarray]:
        """Like `feed`, over `slots` only: per layer [rows, kvH, P, D] copies, row i holding slot slots[i]'s first
        P = aligned(entries) entries and rows past len(slots) zero (inert padding up to an engine's bucket).
        `entries` may reach past `lens` (rows a step wrote with `write`). For a drafter block over a few
        slots of many: the copy is O(len(slots) · P), the whole-buffer feed's engine call O(S · C)."""
        P = aligned(min(entries, self.capacity))
        shape = (rows, self.num_kv_heads, P, self.head_dim)
        feed = {}
        for layer in range(self.num_layers):
            for name, buffer in ((key_name, self.keys[layer]), (value_name, self.values[layer])):
                out = np.empty(shape, np.float32) if rows == len(slots) else np.zeros(shape, np.float32)
                for i, slot in enumerate(slots):      # one copy per slot (a slice, not a fancy-index gather)
                    out[i] = buffer[slot, :, :P]
                feed[f"{name}.{layer}"] = out
        return feed
