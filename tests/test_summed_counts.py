"""`summed_counts`: batch totals of per-request statistics lists of unequal length."""

from dspark.request import summed_counts


def test_requests_without_rounds_add_nothing_and_do_not_truncate():
    # the middle request ended before its first round: its list is empty
    assert summed_counts([[3, 1, 0], [], [2, 2, 1]]) == [5, 3, 1]
    assert summed_counts([[1, 2], [4]]) == [5, 2]
    assert summed_counts([]) == [] and summed_counts([[], []]) == []
