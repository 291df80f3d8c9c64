"""A process's peak resident memory on Linux (CPU: torch keeps no allocator statistics there), read from
``/proc/self/status``: reset the peak to the current size, run, read how far the peak rose.

    before = reset_peak_memory()     # VmHWM := VmRSS (``/proc/self/clear_refs`` "5"); returns VmRSS in kB
    ...                              # the step
    peak_memory(before)              # (VmHWM - before) / 1024 MB

Read by the trainer's metrics and by ``bench train``; imports nothing of flashpar.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_memory() -> int:
    """Free what can be freed (garbage, malloc's free pages), reset the peak resident size (``VmHWM``) to the
    current one (``/proc/self/clear_refs`` "5") and return the current resident size in kB."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: the peak may include memory malloc kept
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS")


def peak_memory(before_kb: int) -> float:
    """MB the peak resident size rose above ``before_kb`` (CPU: torch has no allocator statistics there)."""
    return (_status_kb("VmHWM") - before_kb) / 1024.0
