"""The planner's cost model for a prefill: the model's shape on the devices it runs on, weighted for a forward
pass alone.

A training step weighs attention ``(1 + BWD_ATTN_TIME) / 3`` times what its forward says against the linears
(``CostModel.per_step``); a prefill runs the forward only, so its plans use the cost model as it is: the
per-forward times of ``flashpar.cp.cost``.  The device's figures are rank 0's on every rank
(``flashpar.links.planning_device``: a collective call), so every rank makes the same plan.
"""

from __future__ import annotations

from flashpar.cp import CostModel
from flashpar.cp.cost import cost_model_of
from flashpar.links import planning_device
from flashpar.models import LlamaConfig


def forward_cost(cfg: LlamaConfig, dtype_bytes: int, device_type: str, tp: int = 1) -> CostModel:
    """The forward-only cost model of ``cfg`` with activations of ``dtype_bytes`` (the model's
    ``ParallelOptions.dtype_bytes``) on ``device_type`` (``tp``: the processes of one cp rank, for ranks that
    share a CPU's cores)."""
    hardware, burst = planning_device(device_type, group=tp)
    return cost_model_of(cfg, dtype_bytes, hardware, burst)
