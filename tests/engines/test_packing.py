import numpy as np
import pytest

from dspark_export.engines.packing import Segment, pack_segments


def test_pack_ragged_with_empty_slot_and_padding():
    segs = [Segment(0, np.array([5, 6, 7]), 10), Segment(2, np.array([9]), 4, logits="last")]
    p = pack_segments(segs, 3, np.array([10, 0, 4]), bucket=8)
    f = p.feed
    # 4 padding rows, shortest slots first up to Q = max(3, ⌈8 / 3⌉) = 3: slot 1 gets 3, slot 2 one
    assert f["query_start"].tolist() == [0, 3, 6, 8]
    assert f["input_ids"].tolist() == [5, 6, 7, 0, 0, 0, 9, 0]
    assert f["position_ids"][:3].tolist() == [10, 11, 12] and f["position_ids"][6] == 4
    assert f["position_ids"][7] == 4                        # a padding row: its slot's last position
    assert f["pad_index"].shape == (3, 3)
    assert f["pad_index"][0].tolist() == [0, 1, 2] and f["pad_index"][2].tolist() == [6, 7, 0]
    assert f["logit_rows"].tolist() == [0, 1, 2, 6]
    assert p.row_start == {0: 0, 2: 6} and p.logit_start == {0: 0, 2: 3} and p.num_real_tokens == 4
    assert p.real_rows.tolist() == [0, 1, 2, 6]


@pytest.mark.parametrize("lengths, bucket", [([1] * 15 + [2], 32), ([9, 1, 1, 1], 16), ([1, 0, 0, 0, 0, 0, 0, 0], 8),
                                             ([3, 3], 8), ([1, 2, 3, 4, 5, 6, 7], 64)])
def test_padding_keeps_the_query_width_near_n_over_s(lengths, bucket):
    segs = [Segment(slot, np.arange(q) + 1, 0) for slot, q in enumerate(lengths) if q]
    p = pack_segments(segs, len(lengths), np.zeros(len(lengths), np.int64), bucket)
    widths = np.diff(p.feed["query_start"])
    assert widths.sum() == bucket and np.all(widths >= lengths)       # every slot keeps its rows, N rows in all
    assert p.feed["pad_index"].shape[1] == widths.max() == max(max(lengths), -(-bucket // len(lengths)))
    for slot, q in enumerate(lengths):                                # real rows first in each slot's range
        if q:
            a = p.row_start[slot]
            assert p.feed["input_ids"][a:a + q].tolist() == list(range(1, q + 1))
    assert len(p.real_rows) == sum(lengths) and p.feed["input_ids"][p.real_rows].all()


def test_pack_rejects_overflow():
    with pytest.raises(ValueError, match="do not fit"):
        pack_segments([Segment(0, np.arange(5), 0)], 1, np.zeros(1, np.int64), bucket=4)
