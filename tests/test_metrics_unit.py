"""CPU peak memory from allocator events (executor/cpu_memory.py)."""
from executor.cpu_memory import peak_of_allocations


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


def test_a_collective_block_freed_unseen_counts_until_its_consumer_output():
    # A: an all-gather output; B: its consumer's output; C: a later tensor; then A's address is reused,
    # which proves A was freed without an event (by gloo's thread, after the trainer dropped it)
    ev = [(0, 100, 1000, "gather"), (1, 50, 2000, ""), (2, 70, 3000, ""), (3, 30, 1000, "")]
    assert peak_of_allocations(ev) == 150                        # A + B; not A + B + C = 220
    assert peak_of_allocations([e[:3] for e in ev]) == 220       # without the kind: only address reuse
    # never freed within the step: a backend temporary or an all-gather output is dropped the same way
    for kind in ("temp", "gather"):
        assert peak_of_allocations([(0, 100, 1000, kind), (1, 50, 2000, ""), (2, 70, 3000, "")]) == 150
    # ... but not another collective's output (an all-reduced gradient lives on) ...
    assert peak_of_allocations([(0, 100, 1000, "output"), (1, 50, 2000, ""), (2, 70, 3000, "")]) == 220
    # ... and a collective block freed visibly keeps its recorded lifetime
    ev = [(0, 100, 1000, "gather"), (1, 50, 2000, ""), (2, 70, 3000, ""), (3, -100, 1000, "")]
    assert peak_of_allocations(ev) == 220
