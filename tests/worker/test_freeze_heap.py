import gc

import pytest

from sluice.worker.engine_process import YOUNG_GC_THRESHOLD, freeze_heap


@pytest.fixture
def restored_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_the_heap_at_start_is_frozen_and_young_collections_wait_for_many_objects(restored_gc):
    collections = []

    def callback(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.set_threshold(700, 10, 10)  # CPython's default, whatever the test runner set
    freeze_heap()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold()[0] == YOUNG_GC_THRESHOLD
    gc.callbacks.append(callback)
    try:
        kept = [{"n": i} for i in range(YOUNG_GC_THRESHOLD // 2)]  # a chunk's worth of live requests, many times
        assert collections == []  # at 700 there would have been a dozen
        cycle = [kept]
        cycle.append(cycle)
        del cycle
        assert gc.collect() > 0  # cycles are still found, by the collection that comes
    finally:
        gc.callbacks.remove(callback)
