import gc

import numpy as np
import pytest

from dspark_export.exporter.quantize import KEY_CHUNK, aligned
from dspark_export.runtime.kv_cache import KVArenaPool, KVCache


def _rows(n, layers=2, heads=2, dim=3, offset=0.0):
    k = [np.arange(n * heads * dim, dtype=np.float32).reshape(n, heads, dim) + offset + 100 * l for l in range(layers)]
    return k, [x + 0.5 for x in k]


def test_append_writes_rows_in_slot_order():
    cache = KVCache(2, 3, 2, 3, max_capacity=64, initial_capacity=4)
    k, v = _rows(5)
    slots = np.array([2, 0, 0, 2, 2])
    cache.append(slots, k, v)
    assert cache.lens.tolist() == [2, 0, 3]
    np.testing.assert_array_equal(cache.keys[1][0, :, :2], k[1][[1, 2]].transpose(1, 0, 2))
    np.testing.assert_array_equal(cache.values[0][2, :, :3], v[0][[0, 3, 4]].transpose(1, 0, 2))


def test_append_selected_rows_and_growth_keeps_contents():
    cache = KVCache(1, 2, 2, 3, max_capacity=64, initial_capacity=2)
    k, v = _rows(6, layers=1)
    cache.append(np.array([0, 0]), k, v, rows=np.array([4, 5]))
    before = cache.keys[0][0, :, :2].copy()
    cache.append(np.array([0, 0, 0]), k, v, rows=np.array([0, 1, 2]))  # grows 2 -> 5 entries
    assert cache.capacity >= 5 and cache.lens.tolist() == [5, 0]
    np.testing.assert_array_equal(cache.keys[0][0, :, :2], before)
    np.testing.assert_array_equal(cache.keys[0][0, :, 2:5], k[0][:3].transpose(1, 0, 2))


@pytest.mark.parametrize("seed", range(20))
def test_append_equals_an_entry_by_entry_reference(seed):
    """Random steps (one slot or several, all rows or chosen ones, growth in between) against a plain
    per-entry write: every layer's keys and values land at lens[slot] onward, in order."""
    rng = np.random.default_rng(seed)
    L, S, H, D = 3, 4, 2, 5
    cache = KVCache(L, S, H, D, max_capacity=4096, initial_capacity=2)
    ref_k = [[[] for _ in range(S)] for _ in range(L)]
    ref_v = [[[] for _ in range(S)] for _ in range(L)]
    for _ in range(12):
        n = int(rng.integers(1, 9))
        slots = np.sort(rng.integers(0, S, n)) if rng.random() < 0.5 else np.full(n, int(rng.integers(S)))
        big = n + int(rng.integers(0, 3))
        k = [rng.standard_normal((big, H, D)).astype(np.float32) for _ in range(L)]
        v = [rng.standard_normal((big, H, D)).astype(np.float32) for _ in range(L)]
        rows = np.sort(rng.choice(big, n, replace=False)) if big > n else None
        cache.append(slots, k, v, rows=rows)
        pick = np.arange(n) if rows is None else rows
        for i, slot in enumerate(slots):
            for layer in range(L):
                ref_k[layer][slot].append(k[layer][pick[i]])
                ref_v[layer][slot].append(v[layer][pick[i]])
    for slot in range(S):
        assert cache.lens[slot] == len(ref_k[0][slot])
        for layer in range(L):
            if ref_k[layer][slot]:
                got_k = cache.keys[layer][slot, :, :cache.lens[slot]].transpose(1, 0, 2)
                got_v = cache.values[layer][slot, :, :cache.lens[slot]].transpose(1, 0, 2)
                np.testing.assert_array_equal(got_k, np.stack(ref_k[layer][slot]))
                np.testing.assert_array_equal(got_v, np.stack(ref_v[layer][slot]))


def test_capacity_limit():
    cache = KVCache(1, 1, 1, 1, max_capacity=4, initial_capacity=2)
    k, v = _rows(5, layers=1, heads=1, dim=1)
    with pytest.raises(ValueError, match="capacity 4"):
        cache.append(np.zeros(5, np.int64), k, v)



def test_capacities_are_multiples_of_the_key_chunk():
    """The quantized target reads the cache in KEY_CHUNK chunks in place (`exporter.target._exact_attention`):
    every capacity is a positive multiple of it, and growth stops at the next one that holds the entries."""
    cache = KVCache(1, 1, 1, 1, max_capacity=1000, initial_capacity=2)
    assert cache.capacity == KEY_CHUNK
    cache.reserve(KEY_CHUNK + 1)
    assert cache.capacity == 2 * KEY_CHUNK
    cache.reserve(999)
    assert cache.capacity == 8 * KEY_CHUNK        # 1024: past max_capacity, which bounds entries, not the buffer
    assert [aligned(n) for n in (0, 1, 128, 129)] == [128, 128, 128, 256]


def test_feed_leaves_room_for_the_query_width_past_the_longest_slot():
    """The exact attention scatters a pass's new keys at lens[r] + j for every padded row j < Q: the feed grows
    the buffer so that max lens + Q fits, past max_capacity if need be (a slot near its limit beside a long
    prefill chunk), without touching what the slots hold."""
    cache = KVCache(2, 2, 2, 3, max_capacity=130, initial_capacity=128)
    k, v = _rows(126)
    cache.append(np.zeros(126, np.int64), k, v)
    before = cache.keys[1][0, :, :126].copy()
    assert cache.feed("k", "v", width=2)["k.0"].shape == (2, 2, 128, 3)
    assert cache.attended(3) == 256
    fed = cache.feed("k", "v", width=64)
    assert fed["v.1"].shape == (2, 2, 256, 3) and cache.capacity == 256 and cache.lens.tolist() == [126, 0]
    np.testing.assert_array_equal(cache.keys[1][0, :, :126], before)


def test_feed_trims_one_slot_to_its_entries_and_chunk_rounded_up():
    cache = KVCache(2, 3, 2, 3, max_capacity=512, initial_capacity=256)
    k, v = _rows(70)
    cache.append(np.full(70, 1, np.int64), k, v)                      # slot 1: 70 valid entries
    full = cache.feed("k", "v")
    assert full["k.0"].shape == (3, 2, 256, 3) and np.shares_memory(full["k.0"], cache.keys[0])
    trimmed = cache.feed("k", "v", slot=1, width=8)
    assert set(trimmed) == set(full)
    for name, buf in [("k.0", cache.keys[0]), ("v.1", cache.values[1])]:
        t = trimmed[name]
        assert t.shape == (1, 2, 128, 3) and t.flags.c_contiguous and not np.shares_memory(t, buf)
        np.testing.assert_array_equal(t[0], buf[1, :, :128])         # the valid 70 rows and the rest to 128
    assert cache.feed("k", "v", slot=1, width=59)["k.0"].shape == (1, 2, 256, 3)   # 70 + 59 > 128
    assert cache.feed("k", "v", slot=0, width=1)["k.0"].shape == (1, 2, 128, 3)   # empty slot: one chunk


def test_shrink_halves_to_the_longest_live_slot_and_keeps_its_entries():
    cache = KVCache(2, 3, 2, 3, max_capacity=2048, initial_capacity=128)
    k, v = _rows(1000)
    cache.append(np.zeros(1000, np.int64), k, v)                      # slot 0: 1000 entries → capacity 1024
    cache.append(np.array([2, 2, 2]), *_rows(3, offset=7.0))
    assert cache.capacity == 1024
    assert not cache.shrink()                                         # 1000 > 1024 / 4: stays
    cache.reset(0)
    cache.append(np.full(100, 2, np.int64), *_rows(100))              # longest live slot now 103
    expected = cache.keys[1][2, :, :103].copy()
    assert cache.shrink() and cache.capacity == 256                   # 1024 → 512 → 256; 4 · 103 > 256 stops it
    assert cache.keys[0].shape == (3, 2, 256, 3) and cache.lens.tolist() == [0, 0, 103]
    np.testing.assert_array_equal(cache.keys[1][2, :, :103], expected)
    cache.reset(2)
    assert cache.shrink() and cache.capacity == 128                   # never below the initial capacity
    cache.append(np.zeros(200, np.int64), *_rows(200))               # and it grows again
    assert cache.capacity == 256 and cache.lens.tolist() == [200, 0, 0]


def test_shrink_with_no_slots_returns_to_the_initial_capacity():
    cache = KVCache(1, 0, 1, 1, max_capacity=1024, initial_capacity=256)
    cache.reserve(1000)
    assert cache.capacity == 1024
    assert cache.shrink() and cache.capacity == 256 and cache.keys[0].shape == (0, 1, 256, 1)


def test_gather_copies_chosen_slots_and_pads_with_empty_rows():
    """A drafter block over a few slots: rows in the order asked, entries past `lens` included (a step's
    flushed rows), padding rows zero, P chunk-aligned and within the buffer."""
    cache = KVCache(2, 4, 2, 3, max_capacity=4096, initial_capacity=4)
    k, v = _rows(7)
    cache.append(np.array([3, 3, 1, 1, 1, 0, 3]), k, v)
    extra_k, extra_v = _rows(2, offset=1000.0)
    cache.write(np.array([1, 1]), extra_k, extra_v)            # past lens[1] = 3, not yet valid
    feed = cache.gather("key", "value", [1, 3], rows=4, entries=5)
    assert set(feed) == {"key.0", "key.1", "value.0", "value.1"}
    assert feed["key.0"].shape == (4, 2, aligned(5), 3) and feed["key.0"].flags.c_contiguous
    for layer in range(2):
        np.testing.assert_array_equal(feed[f"key.{layer}"][0, :, :5], cache.keys[layer][1, :, :5])
        np.testing.assert_array_equal(feed[f"value.{layer}"][1, :, :3], cache.values[layer][3, :, :3])
        np.testing.assert_array_equal(feed[f"key.{layer}"][0, :, 3:5], extra_k[layer].transpose(1, 0, 2))
        assert not feed[f"key.{layer}"][2:].any() and not feed[f"value.{layer}"][2:].any()
    feed["key.0"][0] = -1.0                                       # a copy: the cache is untouched
    assert cache.keys[0][1].min() >= 0


class _FreshCopies:
    """The cache's layout semantics with a fresh zeroed array per layout (what the arena must equal)."""

    def __init__(self, cache: KVCache):
        self.cache = cache
        self.keys = [k.copy() for k in cache.keys]
        self.values = [v.copy() for v in cache.values]

    def layout(self, num_slots: int, capacity: int, moves: list[tuple[int, int, int]]):
        c = self.cache
        shape = (num_slots, c.num_kv_heads, capacity, c.head_dim)
        for arrays in (self.keys, self.values):
            for layer, old in enumerate(arrays):
                new = np.zeros(shape, np.float32)
                for o, n, e in moves:
                    new[n, :, :e] = old[o, :, :e]
                arrays[layer] = new


def test_layout_changes_in_the_arena_equal_fresh_copies():
    """Random growth, shrink, remap (compacting and growing the slot count), writes past `lens` and resets:
    after each step every layer equals a fresh zeroed copy of what the step keeps, entries past what was
    kept are zero (the additive mask needs finite values), and shrinks and remaps inside the arena keep
    its memory."""
    rng = np.random.default_rng(0)
    cache = KVCache(3, 2, 2, 4, max_capacity=2048, initial_capacity=128)
    ref = _FreshCopies(cache)
    for step in range(120):
        op = rng.choice(["append", "write", "reset", "shrink", "remap"], p=[0.4, 0.1, 0.15, 0.15, 0.2])
        S, C = cache.num_slots, cache.capacity
        arena = cache._holder[0]
        if op in ("append", "write") and S:
            n = int(rng.integers(1, 300))
            slots = np.sort(rng.integers(0, S, n))
            k, v = _rows(n, layers=3, heads=2, dim=4, offset=float(step * 1000))
            need = int((cache.lens + np.bincount(slots, minlength=S)).max())
            if need > 2048:
                continue
            if need > C:
                kept = min(C, aligned(need))
                ref.layout(S, aligned(need), [(s, s, kept) for s in range(S)])
            getattr(cache, op)(slots, k, v)
            counts = np.bincount(slots, minlength=S)
            for layer in range(3):
                for s in range(S):
                    a = int(cache.lens[s] - counts[s]) if op == "append" else int(cache.lens[s])
                    ref.keys[layer][s, :, a:a + counts[s]] = k[layer][slots == s].transpose(1, 0, 2)
                    ref.values[layer][s, :, a:a + counts[s]] = v[layer][slots == s].transpose(1, 0, 2)
        elif op == "reset" and S:
            cache.reset(int(rng.integers(0, S)))
        elif op == "shrink":
            before = C
            if cache.shrink():
                ref.layout(S, cache.capacity, [(s, s, cache.capacity) for s in range(S)])
                assert cache.capacity < before and np.shares_memory(cache.keys[0], arena)
        elif op == "remap":
            live = [s for s in range(S) if cache.lens[s] > 0]
            size = int(rng.integers(len(live), len(live) + 4)) or 1
            moves = {o: n for n, o in enumerate(live)}
            ref.layout(size, C, [(o, n, int(cache.lens[o])) for o, n in moves.items()])
            cache.remap(size, moves)
            if size * C * 2 * 3 * 2 * 4 <= arena.size:
                assert np.shares_memory(cache.keys[0], arena)
        assert cache.capacity == ref.keys[0].shape[2] and cache.num_slots == ref.keys[0].shape[0]
        for layer in range(3):
            np.testing.assert_array_equal(cache.keys[layer], ref.keys[layer], err_msg=f"step {step} {op}")
            np.testing.assert_array_equal(cache.values[layer], ref.values[layer], err_msg=f"step {step} {op}")
            assert cache.keys[layer].flags.c_contiguous and cache.values[layer].flags.c_contiguous


def test_a_dead_cache_hands_its_arena_to_the_next_one_of_its_shape():
    pool = KVArenaPool()
    cache = KVCache(2, 4, 2, 3, max_capacity=4096, initial_capacity=128)
    assert cache.arena_bytes == 2 * 2 * 4 * 2 * 128 * 3 * 4          # no pool: exactly the first layout
    cache = KVCache(2, 4, 2, 3, max_capacity=4096, initial_capacity=128, pool=pool)
    cache.append(np.array([0, 3, 3]), *_rows(3))
    cache.reserve(1000)
    arena = cache._holder[0]
    assert arena.any()
    del cache
    gc.collect()
    assert pool.held_bytes == arena.nbytes
    other = KVCache(1, 1, 2, 3, max_capacity=4096, initial_capacity=128, pool=pool)   # another shape: a new one
    assert not np.shares_memory(other.keys[0], arena) and pool.held_bytes == arena.nbytes
    again = KVCache(2, 1, 2, 3, max_capacity=4096, initial_capacity=128, pool=pool)
    assert pool.held_bytes == 0 and np.shares_memory(again.keys[1], arena)
    assert not again.keys[1].any() and again.keys[1].shape == (1, 2, 128, 3)


def test_a_cache_dying_inside_a_pool_call_does_not_deadlock():
    """A finalizer may run inside a garbage collection that a pool call's own allocation started, on the same
    thread: giving back must not wait on the pool's lock."""
    import threading
    pool = KVArenaPool()
    cache = KVCache(1, 1, 1, 2, max_capacity=256, pool=pool)
    cache.self_ref = cache                                # a cycle: freed only by the collector
    del cache
    collector = threading.Thread(target=gc.collect, daemon=True)   # runs the finalizer
    with pool._lock:                                      # as if `take` were sorting when the collection runs
        collector.start()
        collector.join(timeout=10)
        assert not collector.is_alive(), "giving an arena back waited on the pool's lock"
    assert pool.held_bytes > 0


def test_remap_refuses_moves_out_of_order():
    cache = KVCache(1, 2, 1, 2, max_capacity=256)
    with pytest.raises(ValueError, match="must increase in both slots"):
        cache.remap(2, {0: 1, 1: 0})


def test_remap_refuses_moves_outside_the_slots():
    cache = KVCache(1, 2, 1, 2, max_capacity=256)
    with pytest.raises(ValueError, match="must lie within 2 → 1 slots"):
        cache.remap(1, {0: 0, 1: 1})


def test_prefault_grows_the_arena_in_place_of_later_growth_and_keeps_contents():
    """After prefault(S, n) the cache's contents are unchanged, and growing to S slots × n entries relays out
    inside the same arena (no fresh pages mid-step); the arena goes to the next cache of its shape."""
    pool = KVArenaPool()
    cache = KVCache(2, 2, 2, 3, max_capacity=4096, initial_capacity=128, pool=pool)
    k, v = _rows(3)
    cache.append(np.array([0, 1, 1]), k, v)
    before = [x.copy() for x in cache.keys + cache.values]
    cache.prefault(4, 1000)
    assert cache.arena_bytes == 2 * 2 * 4 * 2 * aligned(1000) * 3 * 4
    assert cache.lens.tolist() == [1, 2]
    for x, y in zip(cache.keys + cache.values, before):
        np.testing.assert_array_equal(x, y)
    arena = cache._holder[0]
    cache.reserve(1000)
    assert cache._holder[0] is arena and cache.capacity == aligned(1000)
    np.testing.assert_array_equal(cache.keys[1][1, :, :2], k[1][[1, 2]].transpose(1, 0, 2))
    cache.prefault(1, 10)                                           # smaller than the arena: nothing moves
    assert cache._holder[0] is arena
    del cache
    gc.collect()
    again = KVCache(2, 4, 2, 3, max_capacity=4096, initial_capacity=128, pool=pool)
    again.reserve(1000)
    assert np.shares_memory(again.keys[0], arena)


@pytest.mark.parametrize("slots, entries", [(-1, 10), (2, -5), (2.0, 10), (True, 10), (2, "10")])
def test_prefault_refuses_bad_sizes(slots, entries):
    cache = KVCache(2, 2, 2, 3, max_capacity=4096, initial_capacity=128)
    with pytest.raises(ValueError, match="prefault"):
        cache.prefault(slots, entries)
