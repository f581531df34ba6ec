import numpy as np
import pytest

from dspark_export.runtime.kv_cache import KVCache


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


def test_capacity_limit():
    cache = KVCache(1, 1, 1, 1, max_capacity=4, initial_capacity=2)
    k, v = _rows(5, layers=1, heads=1, dim=1)
    with pytest.raises(ValueError, match="capacity 4"):
        cache.append(np.zeros(5, np.int64), k, v)



def test_feed_trims_one_slot_to_its_valid_entries_rounded_up_to_64():
    cache = KVCache(2, 3, 2, 3, max_capacity=512, initial_capacity=256)
    k, v = _rows(70)
    cache.append(np.full(70, 1, np.int64), k, v)                      # slot 1: 70 valid entries
    full = cache.feed("k", "v")
    assert full["k.0"].shape == (3, 2, 256, 3) and np.shares_memory(full["k.0"], cache.keys[0])
    view = cache.feed("k", "v", slot=1)
    assert view["v.1"].shape == (1, 2, 256, 3) and np.shares_memory(view["v.1"], cache.values[1])
    trimmed = cache.feed("k", "v", slot=1, trim=True)
    assert set(trimmed) == set(full)
    for name, buf in [("k.0", cache.keys[0]), ("v.1", cache.values[1])]:
        t = trimmed[name]
        assert t.shape == (1, 2, 128, 3) and t.flags.c_contiguous and not np.shares_memory(t, buf)
        np.testing.assert_array_equal(t[0], buf[1, :, :128])         # the valid 70 rows and padding to 128
    assert cache.feed("k", "v", slot=0, trim=True)["k.0"].shape == (1, 2, 64, 3)   # empty slot: 64
    small = KVCache(2, 1, 2, 3, max_capacity=96, initial_capacity=96)
    small.append(np.zeros(70, np.int64), k, v)                       # ⌈70/64⌉·64 = 128 > capacity 96
    assert small.feed("k", "v", slot=0, trim=True)["k.1"].shape == (1, 2, 96, 3)


def test_shrink_halves_to_the_longest_live_slot_and_keeps_its_entries():
    cache = KVCache(2, 3, 2, 3, max_capacity=64, initial_capacity=4)
    k, v = _rows(40)
    cache.append(np.zeros(40, np.int64), k, v)                        # slot 0: 40 entries → capacity 40
    cache.append(np.array([2, 2, 2]), *_rows(3, offset=7.0))
    assert cache.capacity == 40
    assert not cache.shrink()                                         # 40 > 40 / 4: stays
    cache.reset(0)                                                    # longest live slot now 3
    expected = cache.keys[1][2, :, :3].copy()
    assert cache.shrink() and cache.capacity == 10                    # 40 → 20 → 10; 4 · 3 > 10 stops it
    assert cache.keys[0].shape == (3, 2, 10, 3) and cache.lens.tolist() == [0, 0, 3]
    np.testing.assert_array_equal(cache.keys[1][2, :, :3], expected)
    assert not cache.shrink()
    cache.reset(2)
    assert cache.shrink() and cache.capacity == 4                     # never below the initial capacity
    cache.append(np.zeros(10, np.int64), *_rows(10))                 # and it grows again
    assert cache.capacity >= 10 and cache.lens.tolist() == [10, 0, 0]


def test_shrink_with_no_slots_returns_to_the_initial_capacity():
    cache = KVCache(1, 0, 1, 1, max_capacity=1024, initial_capacity=256)
    cache.reserve(1000)
    assert cache.capacity == 1000
    assert cache.shrink() and cache.capacity == 256 and cache.keys[0].shape == (0, 1, 256, 1)
