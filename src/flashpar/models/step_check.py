"""The cross-rank check of a training step: once per step (all its micro-batches), before the step's first transfer.

The ops of ``ParallelLlama``'s layer loop run with ``check=False``: no per-op all-gather of shapes,
nothing read back to the host.  What their checks compared across ranks follows from what this
check compares once, at the top of ``ParallelLlama.forward``::

    per op (check=True), every linear and cp.attention    here, once per step
    features, heads, head_dim, bias, mode, chunks         the model: config, mode, dp mode, mesh (a digest)
    dtype                                                 the parameters' dtype
    sequence length, split sizes, tokens vs plan          tokens = the plan's count of this cp rank (local);
    plan digest                                           the plan the same on every rank of a dp replica
    'auto' (rank 0's pick binds)                          the cost model's hardware (a digest): every rank's
                                                          pick is then the same function of the same shapes

plus the global target count (the loss's divisor).  Inside the layers every shape is a function of
these: the linears' rows are ``row_sizes(tokens, tp)``, their features and the heads come from the
config.  The check is one all-gather of a few integers over a gloo group of the mesh's ranks
(``flashpar.mesh.host_group``: on a GPU mesh it does not wait for the device); a rank whose own input
is bad raises its error and every other rank raises one naming it (``flashpar.dist.exchange_metadata``),
so a bad input stops every rank before any of the step's communication, each with one line.

It is not skipped when a step's signature repeats: a rank sees only its own signature, and had it
skipped while a peer's had changed, the peer would wait in its check while this rank ran on into the
layers' transfers with sizes the peer does not share: the hang the check exists to prevent.  (The
trainer plans a new sequence every step, so the signature changes every step anyway.)
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from flashpar.cp.attention import plan_digest
from flashpar.cp.cp_plan import CPPlan
from flashpar.dist import DEFAULT_TIMEOUT_S, dtype_code, exchange_metadata, resolve_group
from flashpar.mesh import host_group

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
DTYPE_NAMES = {dtype_code(d): str(d).removeprefix("torch.") for d in DTYPES}

OP = "ParallelLlama"
COLUMNS = ("model (config, mode, dp mode, mesh)", "parameter dtype", "global target count", "cost model hardware")
"""What every rank must share, in the order of the exchanged row (then: dp replica, plan digest)."""


def digest(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class StepCheck:
    """``check(tokens_cp, labels_cp, plan, count, like)`` before a step of the model on ``mesh`` (dims named,
    one of them ``"cp"``, optionally ``"dp"``); ``signature``: what every rank's model must share (its repr
    is digested).  Built by every rank of the world (it may create the gloo group)."""

    def __init__(self, mesh, signature, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        names = mesh.mesh_dim_names
        self.info = resolve_group(host_group(mesh.mesh.flatten().tolist()))
        coord = mesh.get_coordinate()
        self.replica = coord[names.index("dp")] if "dp" in names else 0
        self.cp_rank, self.cp_size = mesh["cp"].get_local_rank(), mesh["cp"].size()
        self.digest, self.timeout_s = digest(repr(signature)), timeout_s
        self.rank = dist.get_rank()

    def __call__(self, tokens_cp, labels_cp, plan, count, like: torch.Tensor, *, auto: bool = False) -> None:
        """Raise on every rank (one line) unless every rank's step input is good and they agree.  ``like``: a
        parameter (its dtype and device are the model's); ``auto``: the mode is ``'auto'``."""
        self.many([(tokens_cp, labels_cp, plan)], count, like, auto=auto)

    def many(self, inputs, count, like: torch.Tensor, *, auto: bool = False) -> None:
        """The check of a step of several micro-batches at once, one exchange for all of them: ``inputs`` is
        ``[(tokens_cp, labels_cp, plan), ...]`` in the order every rank runs them (the plan digests are
        compared in that order)."""
        error: BaseException | None = None
        values: list[int] = []
        try:
            if not inputs:
                raise ValueError(f"{OP}: a step needs at least one micro-batch")
            for tokens_cp, labels_cp, plan in inputs:
                self._local(tokens_cp, labels_cp, plan, like.device)
            plans = plan_digest(inputs[0][2]) if len(inputs) == 1 else digest(repr([plan_digest(p)
                                                                                   for _, _, p in inputs]))
            hardware = 0
            if auto:
                from flashpar.cost import load  # 'auto' picks from these figures

                hardware = digest(repr(load(like.device.type)))
            counted = int(round(count)) if isinstance(count, (int, float)) else -1  # a tensor is not read here
            values = [self.digest, dtype_code(like.dtype), counted, hardware, self.replica, plans]
        except (ValueError, TypeError, OverflowError) as err:
            error, values = err, []
        table = exchange_metadata(self.info, values, device=torch.device("cpu"), op_name=OP, local_error=error,
                                  timeout_s=self.timeout_s).tolist()  # host integers (gloo): no device wait
        for col, what in enumerate(COLUMNS):
            column = [row[col] for row in table]
            if len(set(column)) > 1:
                shown = [DTYPE_NAMES.get(c, c) for c in column] if col == 1 else column
                raise ValueError(f"{OP}: ranks disagree on the {what}: {shown} (rank order)")
        plans: dict[int, set[int]] = {}
        for row in table:
            plans.setdefault(row[len(COLUMNS)], set()).add(row[len(COLUMNS) + 1])
        split = sorted(d for d, seen in plans.items() if len(seen) > 1)
        if split:
            digests = [row[len(COLUMNS) + 1] for row in table]
            raise ValueError(f"{OP}: ranks of dp replica {split[0]} pass different plans (digests {digests}, rank "
                             "order); every rank of a replica must pass the same CPPlans")

    def _local(self, tokens, labels, plan, device) -> None:
        if not isinstance(plan, CPPlan):
            raise TypeError(f"{OP}: plan must be a flashpar.cp.CPPlan, got {type(plan).__name__}")
        if plan.cp_size != self.cp_size:
            raise ValueError(f"{OP}: the plan is for cp_size {plan.cp_size} but the mesh's cp dim has {self.cp_size} "
                             "ranks")
        for name, t in (("tokens", tokens), ("labels", labels)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{OP}: {name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 1 or t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise ValueError(f"{OP}: {name} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
            if t.device != device:
                raise ValueError(f"{OP}: {name} are on {t.device} but the model is on {device}")
        if labels.shape != tokens.shape:
            raise ValueError(f"{OP}: labels {tuple(labels.shape)} do not match tokens {tuple(tokens.shape)}")
        held = sum(b - a for a, b in plan.segments[self.cp_rank])
        if tokens.shape[0] != held:
            raise ValueError(f"{OP}: rank {self.rank} (cp rank {self.cp_rank}) has {tokens.shape[0]} tokens but the "
                             f"plan gives it {held} (shard the sequence with flashpar.cp.shard(x, plan, cp_rank))")
