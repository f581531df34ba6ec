import numpy as np
import pytest

from dspark_export.engines.packing import Segment, pack_segments


def test_pack_ragged_with_empty_slot_and_padding():
    segs = [Segment(0, np.array([5, 6, 7]), 10), Segment(2, np.array([9]), 4, logits="last")]
    p = pack_segments(segs, 3, np.array([10, 0, 4]), bucket=8)
    f = p.feed
    assert f["input_ids"].tolist() == [5, 6, 7, 9, 0, 0, 0, 0]
    assert f["position_ids"][:4].tolist() == [10, 11, 12, 4]
    assert f["query_start"].tolist() == [0, 3, 3, 8]       # padding rows belong to the last segment
    assert f["pad_index"].shape == (3, 5)
    assert f["pad_index"][0, :3].tolist() == [0, 1, 2] and f["pad_index"][2].tolist() == [3, 4, 5, 6, 7]
    assert f["logit_rows"].tolist() == [0, 1, 2, 3]
    assert p.row_start == {0: 0, 2: 3} and p.logit_start == {0: 0, 2: 3} and p.num_real_tokens == 4


def test_pack_rejects_overflow():
    with pytest.raises(ValueError, match="do not fit"):
        pack_segments([Segment(0, np.arange(5), 0)], 1, np.zeros(1, np.int64), bucket=4)
