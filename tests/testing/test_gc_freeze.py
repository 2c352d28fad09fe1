import gc
import weakref

import pytest

from verl_trainer.testing.gc_freeze import freeze_survivors, imports_without_gc


def test_imports_run_without_the_collector_and_what_they_made_is_frozen():
    assert gc.isenabled()
    with imports_without_gc():
        assert not gc.isenabled()
        made = [[] for _ in range(1000)]  # tracked objects, as an import makes them
    assert gc.isenabled()
    walked = {id(obj) for obj in gc.get_objects()}  # what a collection walks: the frozen ones are not in it
    assert all(gc.is_tracked(x) and id(x) not in walked for x in made)
    assert gc.get_freeze_count() >= len(made)


def test_the_collector_is_back_on_when_the_imports_raise_and_stays_off_when_it_was_off():
    with pytest.raises(ImportError), imports_without_gc():
        raise ImportError("no such module")
    assert gc.isenabled()
    gc.disable()
    try:
        with imports_without_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_freeze_survivors_collects_the_garbage_before_freezing():
    collected = []

    class Node:
        pass

    node = Node()
    node.self = node
    weakref.finalize(node, collected.append, True)
    del node
    freeze_survivors()
    assert collected == [True]
