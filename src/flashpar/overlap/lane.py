"""The communication lane: runs a schedule's transfers one after another, beside the main thread's compute.

A lane item is a function that posts torch.distributed work (a batch of
``isend``/``irecv`` or one async collective) and returns the ``Work`` handles.
Items run strictly in submission order and each completes before the next is
posted: the same semantics as a CUDA communication stream, where NCCL calls
issued in order execute in order.

* CPU (gloo): a worker thread posts an item, waits for its handles (``Work.wait``
  releases the GIL, so GEMMs on the main thread run meanwhile), marks it done
  and takes the next.  gloo would otherwise run every posted transfer at once,
  splitting the link between peers so that all peer blocks arrive together at
  the end, which is exactly the exposed tail the flash schedule exists to avoid.
  An item submitted while nothing of its lane is in flight (the first transfer
  of an op; at tp 2 the only one) is posted on the submitting thread instead,
  and waited for there at its ``wait``, unless a later item is queued first:
  that hands it to the worker, which waits for it and then posts the later one::

      one item     main:    | post x_r -> r+1 | GEMM y[r] ....... | wait | GEMM y[r-1]
                   gloo:          |===== x transfer =====|
      two items    main:    | post 1 | queue 2 | GEMM ...........  | wait 1 | GEMM | wait 2 | ...
                   worker:           | wait 1 ......| post 2, wait 2 ......|

  Posted by the worker, a transfer would start only when the worker thread next
  gets a core (with more ranks than cores, up to a scheduler tick, 4 ms at
  HZ=250, after the submit, while the GEMM it should hide behind runs), and its
  completion would reach the main thread through the worker.  Every handle has
  one waiter, and the lane's order is the same either way.
  One worker thread per (process group, calling thread) is started on first use
  and reused by every later op on that group (starting a thread per call costs
  about a millisecond here); it stops when its group is freed (after
  ``destroy_process_group``), so no worker outlives the group it serves.
* CUDA (NCCL): items are posted directly; NCCL orders them on its stream and
  ``Work.wait`` makes the compute stream wait, without blocking the host.

Every wait has a timeout (on NCCL the group's own, enforced by its watchdog: a
timeout passed to ``Work.wait`` would block the host, see ``flashpar.dist.wait_work``);
a failure names the op, this rank and the item (which says which peers were involved).
"""

from __future__ import annotations

import atexit
import functools
import gc
import queue
import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

from flashpar.dist import as_timedelta, stream_waits, wait_work

LaneFn = Callable[[], list]


class LaneError(RuntimeError):
    pass


def _posted(works: list) -> list:
    """The worker's job for an item already posted by the submitting thread: its handles."""
    return works


class _Worker:
    """A daemon thread that runs (lane, item, fn) jobs in order."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="flashpar-lane", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with torch.no_grad():  # grad mode is per thread; the buffers are written under no_grad
            while True:
                lane, item, fn = self.jobs.get()
                if lane is None:  # shutdown
                    return
                lane._execute(item, fn)
                del lane, fn  # the last job's buffers and handles are not kept alive while idle

    def stop(self, timeout_s: float = 5.0) -> None:
        self.jobs.put((None, None, None))
        self.thread.join(timeout_s)


_workers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> {thread id: _Worker}
_workers_lock = threading.Lock()


class _NoGroup:
    """The key of lanes used without an initialised default group."""


_NO_GROUP = _NoGroup()


@atexit.register
def _shutdown() -> None:
    """Stop the worker threads and collect garbage before the interpreter finalizes.

    Transfer handles and groups caught in reference cycles were otherwise freed during
    finalization, and that aborted about one gloo rank exit in four after flash or ring ops
    ("terminate called without an active exception"; measured with 2 ranks: 5 of 20 exits before
    this handler, 0 of 30 with it)."""
    with _workers_lock:
        workers = [w for per_thread in _workers.values() for w in per_thread.values()]
        _workers.clear()
    for worker in workers:
        worker.stop()
    gc.collect()


def _stop_all(per_thread: dict[int, _Worker]) -> None:
    """The group of these workers was freed: stop them (without joining: this may run on any thread)."""
    with _workers_lock:
        workers = list(per_thread.values())
        per_thread.clear()
    for worker in workers:
        worker.jobs.put((None, None, None))


def _group_key(group) -> object:
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else _NO_GROUP


def workers_of(group) -> list[_Worker]:
    """The live lane workers serving ``group`` (``None``: the default group); for tests and diagnostics."""
    with _workers_lock:
        return [w for w in _workers.get(_group_key(group), {}).values() if w.thread.is_alive()]


def _worker_for(group) -> _Worker:
    """The worker of this thread for ``group``, started on first use."""
    key, thread = _group_key(group), threading.get_ident()
    with _workers_lock:
        per_thread = _workers.get(key)
        if per_thread is None:
            per_thread = _workers[key] = {}
            weakref.finalize(key, _stop_all, per_thread)
        worker = per_thread.get(thread)
        if worker is None or not worker.thread.is_alive():
            worker = per_thread[thread] = _Worker()
        return worker


class Lane:
    def __init__(self, op_name: str, rank: int, *, timeout_s: float, threaded: bool, group=None,
                 hold: bool = True) -> None:
        """``group``: the process group the items run on; its worker thread serves this lane.  ``hold=False``:
        every item goes to the worker, none is posted by the submitting thread (lanes of one group that run
        at the same time then post in the order they were submitted, on every rank alike)."""
        self.op_name = op_name
        self.rank = rank
        self.timeout_s = timeout_s
        self.threaded = threaded
        self._done: dict[int, threading.Event] = {}
        self._what: dict[int, str] = {}
        self._works: dict[int, list] = {}  # handles waited for by the main thread
        self._after: dict[int, Callable[[], None] | None] = {}
        self._error: BaseException | None = None
        self._error_item: int | None = None
        self._aborted = False
        self._worker: _Worker | None = None
        self._last: int | None = None  # the last item handed to the worker
        self._held: tuple[int, list] | None = None  # (item, handles): posted by the submitting thread, not yet waited
        self._group = weakref.ref(group) if group is not None else None  # never keeps a group alive
        self._host_waits = not stream_waits(group)  # NCCL: the stream waits, not the host (dist.wait_work)
        self._hold = hold

    def _fail_message(self, item: int, what: str) -> str:
        return f"{self.op_name}: rank {self.rank}: lane item #{item} ({what}) failed"

    def _execute(self, item: int, fn: LaneFn) -> None:
        """Worker thread: post and complete one item (skipped after a failure or an abort)."""
        if self._error is None and not self._aborted:
            try:
                for work in fn():
                    work.wait(as_timedelta(self.timeout_s))
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                self._error, self._error_item = err, item
        self._done[item].set()

    def submit(self, item: int, fn: LaneFn, what: str, after_done: Callable[[], None] | None = None,
               post_now: LaneFn | None = None) -> None:
        """Queue ``fn`` (posts work, returns handles); ``after_done`` runs on the main thread at ``wait``.

        ``post_now``: work posted right away, outside the lane's sequence (the unsequenced side of
        an exchange, see ``Exchange.sequenced``); its handles are waited for at ``wait(item)`` too.
        """
        self._done[item] = threading.Event()
        self._what[item] = what
        self._after[item] = after_done
        if post_now is not None:
            try:
                self._works[item] = post_now()
            except BaseException as err:
                raise LaneError(self._fail_message(item, what) + f": {err}") from err
        if not self.threaded:
            try:
                self._works[item] = self._works.get(item, []) + fn()
            except BaseException as err:
                raise LaneError(self._fail_message(item, what) + f": {err}") from err
            return
        if self._hold and self._held is None and self._worker_idle():
            # nothing of this lane in flight: post here, and let whoever needs the handles first wait for them
            try:
                self._held = (item, fn())
            except BaseException as err:
                raise LaneError(self._fail_message(item, what) + f": {err}") from err
            return
        self._release_held()
        self._queue(item, fn)

    def _worker_idle(self) -> bool:
        """Every item handed to the worker has completed (its job set its event)."""
        return self._error is None and not self._aborted and (self._last is None or self._done[self._last].is_set())

    def _release_held(self) -> None:
        """A later item is queued behind the held one: the worker waits for the held handles first (it becomes
        their one waiter), so the later item is posted only after the held one completed."""
        if self._held is not None:
            item, works = self._held
            self._held = None
            self._queue(item, functools.partial(_posted, works))

    def _queue(self, item: int, fn: LaneFn) -> None:
        if self._worker is None:
            self._worker = _worker_for(self._group() if self._group is not None else None)
        self._last = item
        self._worker.jobs.put((self, item, fn))

    def wait(self, item: int) -> None:
        what = self._what[item]
        if self._held is not None and self._held[0] == item:  # posted here, nothing queued behind: wait here
            self._works[item] = self._held[1] + self._works.get(item, [])
            self._held = None
            self._done[item].set()
        elif self.threaded:
            # The worker's own wait times out first; this margin only guards a stuck worker.
            if not self._done[item].wait(self.timeout_s + 30.0):
                raise LaneError(f"{self._fail_message(item, what)}: no completion within {self.timeout_s:.0f}s")
            if self._error is not None:
                failed = self._error_item if self._error_item is not None else item
                raise LaneError(
                    f"{self._fail_message(failed, self._what.get(failed, what))}: {self._error}"
                ) from self._error
        try:
            for work in self._works.pop(item, []):
                wait_work(work, self.timeout_s, host=self._host_waits)
        except BaseException as err:
            raise LaneError(self._fail_message(item, what) + f": {err}") from err
        after = self._after.pop(item, None)
        if after is not None:
            after()

    def close(self) -> None:
        """Wait for every item, running the ``after_done`` callbacks."""
        for item in list(self._after):
            self.wait(item)

    def abort(self) -> None:
        """Error path: items of this lane not yet posted are skipped (no waiting here)."""
        self._aborted = True
