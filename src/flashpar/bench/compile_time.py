"""Seconds ``torch.compile`` has spent in this process, from torch's own compile metrics, without importing torch.

torch._dynamo times every frame it compiles (``entire_frame_compile``: tracing, AOT autograd, inductor for the
forward) and every backward graph AOT autograd compiles lazily at the first backward through it
(``entire_backward_compile``); ``torch._dynamo.utils.calculate_time_spent()["total_wall_time"]`` is their sum
since the process started.  A bench reads :func:`compile_seconds` before and after a configuration's warm-up to
report its ``compile_s``, and :func:`compiles` around its timed steps to report the compilations there (a
recompilation would be charged to a timed step).  Until something imports ``torch._dynamo`` nothing has been
compiled: both read 0 and torch is not imported.
"""

from __future__ import annotations

import sys

_FRAME, _BACKWARD = "_compile.compile_inner", "backward._backward_impl"  # dynamo_timed keys of the two phases


def compile_seconds() -> float:
    """Wall seconds spent compiling forward frames and backward graphs so far in this process."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0.0
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))


def compiles() -> int:
    """Frames and backward graphs compiled so far in this process (every recompilation counts)."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0
    from torch._dynamo.utils import compilation_time_metrics

    return sum(len(compilation_time_metrics.get(key, ())) for key in (_FRAME, _BACKWARD))
