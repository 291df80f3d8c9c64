"""THE cost model of a machine: read by the overlap simulator and ``auto``, the CP planner, the
trainer's MFU and the benchmarks.

* :mod:`~flashpar.cost.hardware`: :class:`Hardware`, one device and its link: peak FLOP/s, the
  GEMM small-M curve, the attention-kernel efficiency curve, link bandwidth and latency, memory
  bandwidth, and the times they give.
* :mod:`~flashpar.cost.presets`: named machines with their datasheet figures (``h100-nvlink``,
  ``h100-ib``, ``h100-96gb``, ``h200``, ``a100``, ``b200``, ``cpu-calibrated``; aliases ``cpu``, ``cuda``).
* :mod:`~flashpar.cost.nccl`: NCCL's own model of its collectives (latency per hop and protocol, ring, tree,
  PAT), which :meth:`Hardware.collective` uses on the GPU presets.
* :mod:`~flashpar.cost.groups`: the figures of one group of ranks (its link: NVLink on one node, the network
  port across nodes), asked by the simulator and the runtime alike.
* :mod:`~flashpar.cost.cores`: ranks sharing a host's cores (:func:`shared_burst`, :func:`shared_finish`).
* :mod:`~flashpar.cost.store`: the calibration file and :func:`load`, which ``mode="auto"`` asks.
* :mod:`~flashpar.cost.calibrate`: measures a :class:`Hardware` on the running group (imports
  torch; the rest of this package is plain Python and imports neither torch nor
  torch.distributed).

The model's shape (layer sizes, dtype) is the CP planner's :class:`flashpar.cp.CostModel`, which
holds a :class:`Hardware` for its device figures.
"""

from flashpar.cost.cores import shared_burst, shared_finish
from flashpar.cost.groups import group_hardware, nodes_spanned
from flashpar.cost.hardware import Hardware
from flashpar.cost.presets import ALIASES, PRESETS, gpu_preset, preset, preset_name
from flashpar.cost.store import default_path, device_preset, load, parse, save, use

__all__ = ["ALIASES", "PRESETS", "Hardware", "default_path", "device_preset", "gpu_preset",
           "group_hardware", "load", "nodes_spanned", "parse", "preset", "preset_name", "save", "shared_burst",
           "shared_finish", "use"]
