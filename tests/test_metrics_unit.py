"""CPU peak memory from allocator events (executor/metrics.py)."""
from executor.metrics import peak_of_allocations


def test_peak_of_recorded_allocations_and_frees():
    ev = [(0, 100, 1000), (1, 50, 2000), (2, -100, 1000), (3, 30, 1000), (4, -50, 2000)]
    assert peak_of_allocations(ev) == 150
    assert peak_of_allocations(list(reversed(ev))) == 150        # events are ordered by time first


def test_unseen_free_is_inferred_from_address_reuse():
    # the block at 1000 is freed on another thread (no event); the allocator hands 1000 out again
    ev = [(0, 100, 1000), (1, 100, 1000), (2, 100, 1000)]
    assert peak_of_allocations(ev) == 100                        # not 300
    # a new block inside a block still counted as live: that one was freed too
    assert peak_of_allocations([(0, 100, 1000), (1, 60, 1020), (2, 10, 5000)]) == 100
    # adjacent blocks do not overlap
    assert peak_of_allocations([(0, 100, 1000), (1, 100, 1100)]) == 200


def test_frees_of_blocks_from_before_the_window_lower_the_total():
    assert peak_of_allocations([(0, -50, 7), (1, 100, 10)]) == 50
