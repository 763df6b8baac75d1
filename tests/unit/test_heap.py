"""The garbage collector's frozen heap (pdserve/heap.py): what the walks see, and that the
freeze ends with the block or keeps only live objects."""

import gc
import weakref

import pytest

from pdserve.heap import YOUNG_THRESHOLD, freeze_startup_heap, frozen_heap


def walked(obj) -> bool:
    """Whether the collector's generations hold `obj` (the permanent generation is not one)."""
    return any(o is obj for o in gc.get_objects())


@pytest.fixture
def unfrozen():
    assert gc.get_freeze_count() == 0, "another test left the heap frozen"
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_frozen_heap_walks_only_what_the_block_creates(unfrozen):
    before = [[1]]
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        inside = [[2]]
        assert not walked(before)
        assert walked(inside)
    assert gc.get_freeze_count() == 0
    assert walked(before) and walked(inside)


def test_frozen_heap_ends_when_the_block_raises(unfrozen):
    before = [[1]]
    with pytest.raises(KeyError), frozen_heap():
        raise KeyError("x")
    assert gc.get_freeze_count() == 0
    assert walked(before)


def test_frozen_heap_leaves_an_enclosing_freeze_alone(unfrozen):
    before = [[1]]
    with frozen_heap():
        with frozen_heap():
            pass
        assert not walked(before)  # the outer block still holds it frozen
    assert walked(before)


class Node:
    pass


def test_freeze_startup_heap_collects_garbage_first(unfrozen):
    live = [[1]]
    cycle = Node()
    cycle.self = cycle  # only the collector can free it
    gone = weakref.ref(cycle)
    del cycle
    older = gc.get_threshold()[1:]
    frozen = freeze_startup_heap()
    assert frozen == gc.get_freeze_count() > 0
    assert gone() is None  # collected, not frozen for the process' life
    assert not walked(live)
    assert gc.get_threshold() == (YOUNG_THRESHOLD, *older)
