"""The calibration file, and the hardware that ``mode="auto"`` uses.

``flashpar bench overlap --calibrate`` stores what it measured on this machine in a JSON file
(``$XDG_CACHE_HOME/flashpar/hardware.json``, else ``~/.cache/flashpar/hardware.json``), one
entry per device type::

    {"cpu": {"flops": 4.1e10, "half_rows": 12.0, "gemm_overhead_s": 2e-05, ...}}

:func:`load` answers, in order: the hardware of an enclosing :func:`use` block; the file's entry
for the device type; the device type's preset (``cpu`` -> ``cpu-calibrated``, ``cuda`` ->
``h100-ib``).  The file is input: it is read once per process, validated (a JSON object of
entries whose keys are :class:`Hardware` fields and whose values are numbers in range; figures
an entry lacks come from the preset), refused with one line naming it when it is not, and the
first time an entry replaces a preset one log line (``flashpar.cost``, warning level, so it
reaches stderr without any logging setup) names the file and the preset.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, fields, replace
from pathlib import Path

from flashpar.cost.hardware import Hardware
from flashpar.cost.presets import ALIASES, preset, preset_name

log = logging.getLogger("flashpar.cost")

_FIELDS = frozenset(f.name for f in fields(Hardware))
_READ: dict[Path, dict[str, dict[str, float]]] = {}  # file -> its validated entries, read once per process
_ANNOUNCED: set[tuple[Path, str]] = set()  # (file, device type) whose use has been logged
_IN_USE: contextvars.ContextVar[Hardware | None] = contextvars.ContextVar("flashpar_hardware", default=None)


def default_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "flashpar" / "hardware.json"


@contextlib.contextmanager
def use(hardware: Hardware) -> Iterator[None]:
    """Within this block, :func:`load` returns ``hardware`` (e.g. values just measured on an emulated link)."""
    token = _IN_USE.set(hardware)
    try:
        yield
    finally:
        _IN_USE.reset(token)


def device_preset(device_type: str) -> str:
    """The preset a device type falls back to: ``cpu`` and ``cuda`` by alias, any other as ``cpu``."""
    return preset_name(device_type if device_type in ALIASES else "cpu")


def load(device_type: str = "cpu", path: str | os.PathLike | None = None) -> Hardware:
    """The hardware in :func:`use`, else the calibration file's entry for ``device_type``, else its preset.

    Raises ``ValueError`` (one line naming the file) when the file exists but is not a valid
    calibration file."""
    in_use = _IN_USE.get()
    if in_use is not None and path is None:
        return in_use
    name = device_preset(device_type)
    base = preset(name)
    p = Path(path) if path is not None else default_path()
    stored = _entries(p).get(device_type)
    if stored is None:
        return base
    hw = replace(base, **stored)
    if (p, device_type) not in _ANNOUNCED:
        _ANNOUNCED.add((p, device_type))
        log.warning("flashpar.cost: %s figures read from calibration file %s (in place of preset %r; "
                    "read once per process)", device_type, p, name)
    return hw


def save(hardware: Hardware, device_type: str = "cpu", path: str | os.PathLike | None = None) -> Path:
    """Store ``hardware`` for ``device_type`` (other device types in the file are kept; an
    unreadable file is replaced, and said so)."""
    p = Path(path) if path is not None else default_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    _READ.pop(p, None)
    try:
        data = dict(_entries(p))
    except ValueError as e:
        log.warning("flashpar.cost: replacing it: %s", e)
        data = {}
    data[device_type] = asdict(hardware)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(p)
    _READ[p] = data  # what this process wrote is what it reads
    _ANNOUNCED.discard((p, device_type))
    return p


def _entries(p: Path) -> dict[str, dict[str, float]]:
    """The file's validated entries (``{}`` where it does not exist), read once per process."""
    if p not in _READ:
        try:
            text = p.read_text()
        except FileNotFoundError:
            text = "{}"  # no file: the presets (also remembered: a file that appears later is not read)
        except OSError as e:
            raise ValueError(f"calibration file {p}: cannot be read ({e.strerror})") from None
        _READ[p] = parse(text, p)
    return _READ[p]


def parse(text: str, where: Path | str = "calibration file") -> dict[str, dict[str, float]]:
    """Entries of a calibration file's ``text``: ``{device type: {Hardware field: number}}``.

    Raises ``ValueError`` naming ``where`` and the first problem."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"calibration file {where}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {where}: expected a JSON object of device types, got "
                         f"{type(data).__name__}")
    for device_type, entry in data.items():
        if not isinstance(entry, dict):
            raise ValueError(f"calibration file {where}: entry {device_type!r} is not an object")
        unknown = sorted(set(entry) - _FIELDS)
        if unknown:
            raise ValueError(f"calibration file {where}: entry {device_type!r}: unknown figures {unknown} "
                             f"(known: {sorted(_FIELDS)})")
        try:
            replace(preset(device_preset(device_type)), **entry)  # types and ranges: Hardware checks them
        except ValueError as e:
            raise ValueError(f"calibration file {where}: entry {device_type!r}: {e}") from None
    return data
