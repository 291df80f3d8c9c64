"""The communication lane: runs a schedule's transfers one after another, off the main thread.

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
* CUDA (NCCL): items are posted directly; NCCL orders them on its stream and
  ``Work.wait`` makes the compute stream wait, without blocking the host.

Every wait has a timeout; a failure names the op, this rank and the item
(which says which peers were involved).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import torch

from flashpar.dist import as_timedelta

LaneFn = Callable[[], list]


class LaneError(RuntimeError):
    pass


class Lane:
    def __init__(self, op_name: str, rank: int, *, timeout_s: float, threaded: bool) -> None:
        self.op_name = op_name
        self.rank = rank
        self.timeout_s = timeout_s
        self.threaded = threaded
        self._done: dict[int, threading.Event] = {}
        self._what: dict[int, str] = {}
        self._works: dict[int, list] = {}
        self._after: dict[int, Callable[[], None] | None] = {}
        self._error: BaseException | None = None
        self._error_item: int | None = None
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    def _fail_message(self, item: int, what: str) -> str:
        return f"{self.op_name}: rank {self.rank}: lane item #{item} ({what}) failed"

    def _start(self) -> None:
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._worker, name=f"flashpar-lane-{self.op_name}", daemon=True)
        self._thread.start()

    def _worker(self) -> None:
        assert self._queue is not None
        with torch.no_grad():  # grad mode is per thread; the buffers are written under no_grad
            self._work_loop()

    def _work_loop(self) -> None:
        assert self._queue is not None
        while True:
            job = self._queue.get()
            if job is None:
                return
            item, fn = job
            if self._error is None:
                try:
                    for work in fn():
                        work.wait(as_timedelta(self.timeout_s))
                except BaseException as err:  # noqa: BLE001 - handed to the main thread
                    self._error, self._error_item = err, item
            self._done[item].set()

    def submit(self, item: int, fn: LaneFn, what: str, after_done: Callable[[], None] | None = None) -> None:
        """Queue ``fn`` (posts work, returns handles); ``after_done`` runs on the main thread at ``wait``."""
        self._done[item] = threading.Event()
        self._what[item] = what
        self._after[item] = after_done
        if not self.threaded:
            try:
                self._works[item] = fn()
            except BaseException as err:
                raise LaneError(self._fail_message(item, what) + f": {err}") from err
            return
        if self._thread is None:
            self._start()
        assert self._queue is not None
        self._queue.put((item, fn))

    def wait(self, item: int) -> None:
        what = self._what[item]
        if self.threaded:
            # The worker's own wait times out first; this margin only guards a stuck worker.
            if not self._done[item].wait(self.timeout_s + 30.0):
                raise LaneError(f"{self._fail_message(item, what)}: no completion within {self.timeout_s:.0f}s")
            if self._error is not None:
                failed = self._error_item if self._error_item is not None else item
                raise LaneError(
                    f"{self._fail_message(failed, self._what.get(failed, what))}: {self._error}"
                ) from self._error
        else:
            try:
                for work in self._works.pop(item, []):
                    work.wait(as_timedelta(self.timeout_s))
            except BaseException as err:
                raise LaneError(self._fail_message(item, what) + f": {err}") from err
        after = self._after.pop(item, None)
        if after is not None:
            after()

    def close(self) -> None:
        """Wait for every item (running ``after_done`` callbacks) and stop the worker."""
        try:
            for item in list(self._after):
                self.wait(item)
        finally:
            self.stop()

    def stop(self) -> None:
        """Stop the worker after the items already queued (used on error paths: no waiting here)."""
        if self._thread is not None:
            assert self._queue is not None
            self._queue.put(None)
            self._thread = None
