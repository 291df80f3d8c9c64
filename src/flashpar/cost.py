"""Hardware cost parameters shared by planners, ``auto`` modes, benchmarks and simulators.

    gemm_time(m, k, n)  = overhead + 2 k n (m + half_rows) / flops
                          (rate approaches ``flops`` for m >> half_rows: a GEMM of few rows
                           runs far below peak, which is what makes decomposition costly at small M)
    transfer_time(b)    = latency + b / link_bytes_per_s
    memory_time(b)      = b / memory_bytes_per_s          (element-wise passes such as adding partials)

Defaults: ``cpu`` is a rough 2-core box; ``cuda`` an H100-class GPU with a 400 Gb/s link.
``flashpar bench overlap --calibrate`` measures this machine and stores the values
(JSON, ``~/.cache/flashpar/hardware.json`` unless a path is given); :func:`load`
returns the stored values where they exist, the defaults elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class Hardware:
    flops: float  # sustained GEMM FLOP/s at large M
    half_rows: float  # rows at which a GEMM reaches half of ``flops``
    gemm_overhead_s: float  # fixed cost per GEMM call
    link_bytes_per_s: float  # one direction of one rank's link
    link_latency_s: float  # per message
    memory_bytes_per_s: float

    def gemm_time(self, m: int, k: int, n: int) -> float:
        if m <= 0:
            return 0.0
        return self.gemm_overhead_s + 2.0 * k * n * (m + self.half_rows) / self.flops

    def transfer_time(self, nbytes: float) -> float:
        return self.link_latency_s + nbytes / self.link_bytes_per_s

    def memory_time(self, nbytes: float) -> float:
        return nbytes / self.memory_bytes_per_s


DEFAULTS = {
    "cpu": Hardware(
        flops=4e10, half_rows=16, gemm_overhead_s=2e-5,
        link_bytes_per_s=1.25e8, link_latency_s=1e-4, memory_bytes_per_s=1e10,
    ),
    "cuda": Hardware(
        flops=6e14, half_rows=512, gemm_overhead_s=8e-6,
        link_bytes_per_s=5e10, link_latency_s=1.5e-5, memory_bytes_per_s=2.5e12,
    ),
}


def default_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flashpar" / "hardware.json"


_IN_USE: contextvars.ContextVar[Hardware | None] = contextvars.ContextVar("flashpar_hardware", default=None)


@contextlib.contextmanager
def use(hardware: Hardware) -> Iterator[None]:
    """Within this block, :func:`load` returns ``hardware`` (e.g. values just measured on an emulated link)."""
    token = _IN_USE.set(hardware)
    try:
        yield
    finally:
        _IN_USE.reset(token)


def load(device_type: str = "cpu", path: str | os.PathLike | None = None) -> Hardware:
    """The hardware in :func:`use`, else the stored calibration for ``device_type``, else the defaults."""
    in_use = _IN_USE.get()
    if in_use is not None and path is None:
        return in_use
    fallback = DEFAULTS.get(device_type, DEFAULTS["cpu"])
    p = Path(path) if path is not None else default_path()
    try:
        stored = _read(str(p), p.stat().st_mtime_ns).get(device_type)
    except (OSError, ValueError, AttributeError):
        return fallback
    if not isinstance(stored, dict):
        return fallback
    names = {f.name for f in fields(Hardware)}
    try:
        return Hardware(**{**asdict(fallback), **{k: float(v) for k, v in stored.items() if k in names}})
    except (TypeError, ValueError):
        return fallback


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int) -> dict:
    """The stored file, parsed once per modification (``auto`` consults it on every call)."""
    return json.loads(Path(path).read_text())


def save(hardware: Hardware, device_type: str = "cpu", path: str | os.PathLike | None = None) -> Path:
    """Store ``hardware`` for ``device_type`` (other device types in the file are kept)."""
    p = Path(path) if path is not None else default_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(p.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[device_type] = asdict(hardware)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(p)
    return p
