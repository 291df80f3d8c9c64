"""The CPU lane (``flashpar.overlap.lane``): an item submitted while nothing of its lane is in flight is posted
on the calling thread (the transfer starts at once, not when the worker thread next gets a core) and, if nothing
is queued behind it, waited for there too; an item submitted behind it hands it to the worker, which waits for
it and only then posts the later one.  Every handle has exactly one waiter.  Single process, fake transfers:
each "work" is a handle whose ``wait`` blocks until the test releases it."""

from __future__ import annotations

import threading

import pytest

from flashpar.overlap.lane import Lane, LaneError


class FakeWork:
    """A transfer handle: ``wait`` blocks until ``release()``; records which thread waited, and how often."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name
        self.released = threading.Event()
        self.waiters: list[int] = []

    def release(self) -> None:
        self.released.set()

    def wait(self, timeout=None) -> bool:
        self.waiters.append(threading.get_ident())
        if not self.released.wait(10.0):
            raise RuntimeError(f"{self.name} never released")
        self.log.append(f"{self.name} done")
        return True


def poster(log: list, name: str, work: FakeWork):
    """A lane item: records the posting thread, returns the handle."""

    def fn() -> list:
        log.append((f"{name} posted", threading.get_ident()))
        return [work]

    return fn


def test_an_item_of_an_idle_lane_is_posted_and_waited_on_the_calling_thread():
    log: list = []
    lane = Lane("op", 0, timeout_s=10.0, threaded=True)
    work = FakeWork(log, "a")
    work.release()
    lane.submit(0, poster(log, "a", work), "item a")
    assert log[0] == ("a posted", threading.get_ident())  # posted before submit returned, here
    lane.wait(0)
    assert work.waiters == [threading.get_ident()]  # one waiter: this thread (no worker hop at all)
    lane.close()


def test_an_item_submitted_while_one_is_in_flight_is_posted_by_the_worker_after_it_completed():
    log: list = []
    lane = Lane("op", 0, timeout_s=10.0, threaded=True)
    first, second = FakeWork(log, "a"), FakeWork(log, "b")
    lane.submit(0, poster(log, "a", first), "item a")
    lane.submit(1, poster(log, "b", second), "item b")  # a is still in flight: b queues behind it
    assert [entry for entry in log if isinstance(entry, tuple)] == [("a posted", threading.get_ident())]
    first.release()
    second.release()
    lane.wait(0)
    lane.wait(1)
    names = [entry[0] if isinstance(entry, tuple) else entry for entry in log]
    assert names == ["a posted", "a done", "b posted", "b done"]  # b posted only after a completed
    assert log[2][1] != threading.get_ident()  # by the worker
    assert len(first.waiters) == 1 and first.waiters[0] != threading.get_ident()  # a handed to the worker
    assert len(second.waiters) == 1 and second.waiters[0] != threading.get_ident()
    # the lane is idle again: the next item is posted here
    third = FakeWork(log, "c")
    third.release()
    lane.submit(2, poster(log, "c", third), "item c")
    assert log[-1] == ("c posted", threading.get_ident())
    lane.close()
    assert third.waiters == [threading.get_ident()]


def test_a_failed_post_on_an_idle_lane_raises_on_the_calling_thread_naming_the_op_and_item():
    lane = Lane("all_gather_matmul", 3, timeout_s=10.0, threaded=True)

    def broken() -> list:
        raise RuntimeError("peer gone")

    with pytest.raises(LaneError, match=r"all_gather_matmul: rank 3: lane item #7 \(send x to rank 1\) failed: "
                                        r"peer gone"):
        lane.submit(7, broken, "send x to rank 1")
    lane.abort()


def test_after_an_item_failed_in_flight_later_items_are_not_posted_and_wait_names_the_failure():
    log: list = []
    lane = Lane("op", 0, timeout_s=10.0, threaded=True)

    class FailingWork(FakeWork):
        def wait(self, timeout=None) -> bool:
            self.released.wait(10.0)
            raise RuntimeError("connection reset")

    failing, behind = FailingWork(log, "a"), FakeWork(log, "b")
    behind.release()
    lane.submit(0, poster(log, "a", failing), "item a")  # posted here
    lane.submit(1, poster(log, "b", behind), "item b")  # queued: the worker waits for a, which fails
    failing.release()
    with pytest.raises(LaneError, match=r"lane item #0 \(item a\) failed: connection reset"):
        lane.wait(0)
    with pytest.raises(LaneError, match=r"lane item #0 \(item a\) failed"):
        lane.wait(1)
    later = FakeWork(log, "c")
    later.release()
    lane.submit(2, poster(log, "c", later), "item c")  # the lane failed: not posted here
    with pytest.raises(LaneError, match=r"lane item #0 \(item a\) failed"):
        lane.wait(2)
    posted = [entry[0] for entry in log if isinstance(entry, tuple)]
    assert posted == ["a posted"]  # neither b nor c was posted anywhere


def test_a_failed_wait_on_the_calling_thread_names_the_item():
    log: list = []
    lane = Lane("matmul_reduce_scatter", 1, timeout_s=10.0, threaded=True)

    class FailingWork(FakeWork):
        def wait(self, timeout=None) -> bool:
            raise RuntimeError("peer closed the connection")

    lane.submit(4, poster(log, "a", FailingWork(log, "a")), "recv recv from rank 0")
    with pytest.raises(LaneError, match=r"matmul_reduce_scatter: rank 1: lane item #4 \(recv recv from rank 0\) "
                                        r"failed: peer closed the connection"):
        lane.wait(4)
