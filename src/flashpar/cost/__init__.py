"""THE cost model of a machine: read by the overlap simulator and ``auto``, the CP planner, the
trainer's MFU and the benchmarks.

* :mod:`~flashpar.cost.hardware`: :class:`Hardware`, one device and its link: peak FLOP/s, the
  GEMM small-M curve, the attention-kernel efficiency curve, link bandwidth and latency, memory
  bandwidth, and the times they give.
* :mod:`~flashpar.cost.presets`: named machines with their datasheet figures (``h100-nvlink``,
  ``h100-ib``, ``h100-96gb``, ``h200``, ``a100``, ``b200``, ``cpu-calibrated``; aliases ``cpu``, ``cuda``).
* :mod:`~flashpar.cost.store`: the calibration file and :func:`load`, which ``mode="auto"`` asks.
* :mod:`~flashpar.cost.calibrate`: measures a :class:`Hardware` on the running group (imports
  torch; the rest of this package is plain Python and imports neither torch nor
  torch.distributed).

The model's shape (layer sizes, dtype) is the CP planner's :class:`flashpar.cp.CostModel`, which
holds a :class:`Hardware` for its device figures.
"""

from flashpar.cost.hardware import Hardware
from flashpar.cost.presets import ALIASES, PRESETS, gpu_hardware, gpu_preset, preset, preset_name
from flashpar.cost.store import default_path, device_preset, load, parse, save, use

__all__ = ["ALIASES", "PRESETS", "Hardware", "default_path", "device_preset", "gpu_hardware", "gpu_preset", "load",
           "parse", "preset", "preset_name", "save", "use"]
