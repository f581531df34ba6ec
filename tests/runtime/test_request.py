"""Per-request statistics."""


def test_per_position_acceptance_counters():
    from dspark_export.runtime.request import RequestStats

    st = RequestStats()
    st.observe_round(4, 2)   # drafts 0,1 accepted, 2 rejected, 3 never reached
    st.observe_round(4, 4)   # all accepted
    st.observe_round(0, 0)   # ar round: nothing verified
    st.observe_round(2, 0)
    assert st.reached_per_position == [3, 2, 2, 1]
    assert st.accepted_per_position == [2, 2, 1, 1]
