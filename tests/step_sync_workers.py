"""Per-rank bodies of ``test_step_sync``: what one training step sends and reads back to the host, counted.

:class:`Counting` wraps, for the time of a ``with`` block,

* every torch.distributed communication call (collectives by name; ``isend`` / ``irecv`` as ``p2p``
  messages, also those a ``batch_isend_irecv`` posts) and group creation (``new_group``), wherever
  it is called from: flashpar code calls them, directly or from the lane's thread;
* ``flashpar.dist.exchange_metadata``, the cross-rank shape / plan check (``meta``);
* host reads and host -> device copies made *by flashpar code* (the calling frame's file is under
  ``src/flashpar``): ``Tensor.item / cpu / tolist / numpy``, ``int() / float() / bool()`` of a tensor,
  ``Tensor.to(device)`` and ``flashpar.cp.layout.to_device`` (every call naming a device, also where
  it is a no-op on this CPU machine: on a GPU it is a copy) and ``flashpar.cp.kernels.Batch.to`` (the
  index tensors of an attention batch moved to the activations' device).  Calls from torch itself
  (AdamW reads its step counters with ``.item()``: torch's, on CPU tensors) are not counted.

:func:`layer_comm` derives, without running anything, the communication one decoder layer needs in
a training step: the transfers and collectives of the schedules its ops run (``build_schedule`` of
the four linears forward and backward, ``kv_schedule`` of ``cp.attention`` forward and backward,
a message counted where the executor posts it: when it carries rows), the ZeRO-3 weight gathers
and gradient reduce-scatters (a fused layer's in its schedules; a prefetched layer's unit: one all-gather
in forward, one again in backward, one reduce-scatter), and the gradient all-reduces of the layer's
parameters.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import flashpar
from flashpar import cp
from flashpar.cp import layout as cp_layout
from flashpar.cp.attention import plan_digest
from flashpar.cp.exchange import kv_schedule
from flashpar.cp.kernels import Batch
from flashpar.cp.layout import rank_layout
from flashpar.dist import exchange_metadata
from flashpar.models import LlamaConfig
from flashpar.models.layout import layout_of
from flashpar.overlap.call import DEFAULT_CHUNKS
from flashpar.overlap.schedule import Collective, Exchange, build_schedule

SRC = os.path.dirname(flashpar.__file__)
P2P = ("isend", "irecv", "send", "recv")
COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_reduce", "all_gather", "all_to_all_single", "all_to_all", "broadcast", "barrier", "reduce",
               "gather", "scatter", "new_group")
HOST_READS = ("item", "cpu", "tolist", "numpy", "__int__", "__float__", "__bool__")
COLLECTIVE_OF_KIND = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce",
                      "all_to_all": "all_to_all"}
"""Schedule collective kinds -> the counters' names (aliases of one collective are counted as one)."""


def _canonical(name: str) -> str:
    """One counter per collective: ``all_gather_into_tensor`` and its torch 2.13 name ``all_gather_single``
    are the same collective (one may call the other; only the outermost call is counted)."""
    return {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
            "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
            "all_to_all_single": "all_to_all"}.get(name, name)


class Counting:
    """``with Counting() as c: ...`` then ``c.counts`` (a Counter: see the module docstring)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._undo: list = []

    def _add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    # -- wrappers --------------------------------------------------------------------------------

    def _wrap_dist(self, name: str, fn):
        counter = self

        def wrapper(*args, **kwargs):
            depth = getattr(counter._local, "depth", 0)
            if depth == 0:
                if name in P2P:
                    counter._add("p2p")
                elif name == "batch_isend_irecv":
                    counter._add("p2p_batches")
                else:
                    counter._add(_canonical(name))
            # a batch's isend / irecv are its messages: counted (depth stays 0 for them); inside any other
            # call (an alias calling the other name) nothing more is counted
            counter._local.depth = depth + (0 if name == "batch_isend_irecv" else 1)
            try:
                return fn(*args, **kwargs)
            finally:
                counter._local.depth = depth

        return wrapper

    def _wrap_host(self, key: str, fn, *, device_only: bool = False):
        counter = self

        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(SRC) and (not device_only or _names_device(args[1:], kwargs)):
                counter._add(key)
            return fn(*args, **kwargs)

        return wrapper

    def _patch(self, owner, attr: str, new) -> None:
        self._undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, new)

    def _patch_everywhere(self, original, new) -> None:
        """Replace ``original`` by ``new`` in every loaded flashpar / torch.distributed module that holds it
        (``from x import f`` bound it at import time)."""
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not (mod_name.startswith("flashpar") or mod_name.startswith("torch.distributed")):
                continue
            for attr, value in list(vars(mod).items()):
                if value is original:
                    self._patch(mod, attr, new)

    def __enter__(self) -> Counting:
        seen = set()
        for name in (*P2P, "batch_isend_irecv", *COLLECTIVES):
            fn = getattr(dist, name, None)
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            self._patch_everywhere(fn, self._wrap_dist(name, fn))
        meta = self._wrap_host_any("meta", exchange_metadata)
        self._patch_everywhere(exchange_metadata, meta)
        for name in HOST_READS:
            self._patch(torch.Tensor, name, self._wrap_host(name.strip("_"), getattr(torch.Tensor, name)))
        self._patch(torch.Tensor, "to", self._wrap_host("to_device", torch.Tensor.to, device_only=True))
        self._patch(Batch, "to", self._wrap_host("batch_to", Batch.to))
        to_device = getattr(cp_layout, "to_device", None)  # (absent before the step check: the test then fails)
        if to_device is not None:
            self._patch_everywhere(to_device, self._wrap_host("to_device", to_device))
        return self

    def _wrap_host_any(self, key: str, fn):
        counter = self

        def wrapper(*args, **kwargs):
            counter._add(key)
            return fn(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc) -> None:
        for owner, attr, old in reversed(self._undo):
            setattr(owner, attr, old)
        self._undo.clear()


def _names_device(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names a device (a copy on a GPU), not only a dtype."""
    if "device" in kwargs:
        return True
    return any(isinstance(a, (torch.device, str, int, torch.Tensor)) and not isinstance(a, bool) for a in args)


HOST_KEYS = ("item", "cpu", "tolist", "numpy", "int", "float", "bool", "to_device", "batch_to")
COMM_KEYS = ("p2p", "all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "barrier", "reduce",
             "gather", "scatter", "new_group")


# ---- what one layer needs -------------------------------------------------------------------------


def _schedule_comm(schedule, rows_of) -> collections.Counter:
    """Messages (``p2p``, those carrying rows: ``rows_of(buffer, piece, peer)`` > 0) and collectives of a
    schedule, counted as the executor posts them."""
    out: collections.Counter = collections.Counter()
    for step in schedule.steps:
        if isinstance(step, Exchange):
            out["p2p"] += sum(rows_of(t.buffer, t.piece, t.peer) > 0 for t in (*step.sends, *step.recvs))
        elif isinstance(step, Collective):
            out[COLLECTIVE_OF_KIND[step.kind]] += 1
    return out


def layer_comm(model, plan, tokens: int) -> collections.Counter:
    """The communication of one ``ParallelBlock`` in one training step (forward, backward, gradient sums)."""
    block = model.blocks[0]
    tp, tp_rank = model.tp, model.tp_rank
    split = [tokens // tp + (p < tokens % tp) for p in range(tp)]
    assert all(split), f"every tp block must hold rows for this count (split {split})"
    out: collections.Counter = collections.Counter()
    mode = model.mode if tp > 1 else "none"
    every_row = lambda *_: 1  # noqa: E731 - the blocks are non-empty (asserted above)
    for linear, gather_side in ((block.qkv, True), (block.o_proj, False), (block.gate_up, True), (block.down, False)):
        chunks = linear.chunks or DEFAULT_CHUNKS[mode]
        dp_group = getattr(linear, "dp_group", None)
        if dp_group is not None and linear.source is None:  # fused ZeRO-3 (overlap/sharded.py): dp schedules with
            # the tp schedules nested inside
            dp_mode, dp, dp_rank = model.mode, dist.get_world_size(dp_group), dist.get_rank(dp_group)
            fwd = build_schedule("sharded", dp_mode, dp, dp_rank, chunks=DEFAULT_CHUNKS[dp_mode])
            scheds = [fwd, build_schedule("sharded_bwd", dp_mode, dp, dp_rank, chunks=DEFAULT_CHUNKS[dp_mode],
                                          grad_input=True, grad_weight=True)]
            if tp > 1:
                tp_gather = build_schedule("matmul_rs_bwd", mode, tp, tp_rank, chunks=chunks, grad_input=False,
                                           grad_weight=True)
                tp_scatter = build_schedule("matmul_rs", mode, tp, tp_rank, chunks=chunks)
                if gather_side:  # x gathered in forward and again in backward; grad_x reduce-scattered once
                    scheds += [tp_gather, tp_gather, tp_scatter]
                else:  # one tp reduce-scatter per dp piece of the forward; grad_y gathered once in backward
                    pieces = sum(1 for c in fwd.computes() if c.gemm == "y")
                    scheds += [tp_scatter] * pieces + [tp_gather]
        elif gather_side:  # ColumnParallelLinear: forward all-gather of x; backward re-gather + reduce-scatter
            scheds = [build_schedule("ag_matmul", mode, tp, tp_rank, chunks=chunks),
                      build_schedule("ag_matmul_bwd", mode, tp, tp_rank, chunks=chunks,
                                     regather=not linear.save_gathered)]
        else:  # RowParallelLinear (no bias): forward reduce-scatter; backward all-gather of grad_y
            scheds = [build_schedule("matmul_rs", mode, tp, tp_rank, chunks=chunks),
                      build_schedule("matmul_rs_bwd", mode, tp, tp_rank, chunks=chunks)]
        for s in scheds:
            out += _schedule_comm(s, every_row)
    if plan.cp_size > 1:
        layout = rank_layout(plan, model.cp_rank)

        def kv_rows(buffer, piece, peer):
            if buffer in ("gk", "gv"):  # a received block's gradient, returned to its origin
                return layout.recv_tokens(piece.block)
            return layout.held_rows(piece.block, peer)

        for direction in ("forward", "backward"):
            out += _schedule_comm(kv_schedule(layout, direction), kv_rows)
    if block.qkv.source is not None:  # a prefetched unit (overlap/prefetch.py), not the kept last one
        out["all_gather"] += 2
        out["reduce_scatter"] += 1
    for name, _ in block.named_parameters(prefix="blocks.0"):
        kind = layout_of(name)[0].grad_sum(model.zero)
        if kind != "zero" and model._sum_groups[kind] is not None:
            out["all_reduce"] += 1  # reduce_grads: the sum over the ranks holding copies
    return out


# ---- the steps --------------------------------------------------------------------------------------

CFG = LlamaConfig(hidden=32, layers=1, heads=4, kv_heads=2, ffn=64)


def batch(dp: int, seed: int):
    """``dp`` packed sequences ``(tokens, labels, doc_lens)`` (labels: the next token of the same document)."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(dp):
        doc_lens = [rng.choice([3, 8, 17, 30]) for _ in range(5)]
        tokens = torch.tensor([rng.randrange(256) for _ in range(sum(doc_lens))])
        labels = torch.roll(tokens, -1)
        labels[torch.tensor(doc_lens).cumsum(0) - 1] = -100
        out.append((tokens, labels, doc_lens))
    return out


def _model(mesh_shape, layers: int, mode: str, dp_mode: str, strategy: str):
    import dataclasses

    from flashpar.train.config import TrainConfig
    from flashpar.train.step import build

    dp, cpn, tp = mesh_shape
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "cp", "tp"))
    config = TrainConfig(nproc=dp * cpn * tp, dp=dp, cp=cpn, tp=tp, strategy=strategy, mode=mode, dp_mode=dp_mode,
                         model=dataclasses.replace(CFG, layers=layers), timeout=60.0)
    _, model, opt = build(config, mesh, torch.device("cpu"))
    return mesh, model, opt


def _inputs(mesh, seed: int, strategy: str, plan=None):
    """This rank's ``(tokens, labels, plan, count)`` of the dp rank's sequence of ``batch(dp, seed)``."""
    dp_rank, c = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    seqs = batch(mesh["dp"].size(), seed)
    count = sum(int((lab != -100).sum()) for _, lab, _ in seqs)
    tokens, labels, doc_lens = seqs[dp_rank]
    plan = plan or cp.plan(doc_lens, mesh["cp"].size(), strategy=strategy)
    return cp.shard(tokens, plan, c), cp.shard(labels, plan, c), plan, count


def count_steps(rank, world, mesh_shape, layer_counts, mode="flash", dp_mode="zero3", strategy="flashcp"):
    """``{layers: (counts of one steady-state train_step, layer_comm of it, loss)}``: per layer count, a model
    is built and trained one step (warm-up: the twin p2p groups are created there), then one step on a new
    sequence is counted, its plan's caches cleared first (every layer count meets it as new, as every
    trainer step meets a new plan: what is built once per plan is counted once per step)."""
    from flashpar.train.step import train_step

    out = {}
    for layers in layer_counts:
        mesh, model, opt = _model(mesh_shape, layers, mode, dp_mode, strategy)
        train_step(model, opt, *_inputs(mesh, 0, strategy))
        tokens, labels, plan, count = _inputs(mesh, 1, strategy)
        for cache in (rank_layout, getattr(cp_layout, "device_layout", None), plan_digest):
            if cache is not None:  # a plan never seen, as every trainer step's
                cache.cache_clear()
        dist.barrier()
        with Counting() as counting:
            loss = train_step(model, opt, tokens, labels, plan, count)
        dist.barrier()
        out[layers] = (dict(counting.counts), dict(layer_comm(model, plan, tokens.shape[0])), float(loss))
    return out


# ---- bad input: one clear line on every rank --------------------------------------------------------


def bad_inputs(rank, world, mesh_shape):
    """``{case: (exception type name, message)}`` of a ``train_step`` on bad input, per case (``None``: it
    ran).  Every case must raise on every rank before any of the step's communication."""
    from flashpar.train.step import train_step

    mesh, model, opt = _model(mesh_shape, 2, "flash", "zero3", "flashcp")
    tokens, labels, plan, count = _inputs(mesh, 0, "flashcp")
    other = _inputs(mesh, 0, "flashcp", plan=cp.plan(plan.doc_lens, plan.cp_size, strategy="per_doc"))
    cases = {
        "one rank drops a token": lambda: (tokens[:-1], labels[:-1], plan, count) if rank == 1 else None,
        "ranks pass different plans": lambda: other if rank == 0 else None,
        "one rank's labels do not match its tokens": lambda: (tokens, labels[:-1], plan, count) if rank == 2 else None,
        "one rank passes float tokens": lambda: (tokens.float(), labels, plan, count) if rank == 3 else None,
        "ranks disagree on the target count": lambda: (tokens, labels, plan, count + 1) if rank == 0 else None,
        "a plan for another cp size": lambda: (tokens, labels, cp.plan(plan.doc_lens, 1), count) if rank == 1 else None,
    }
    out = {}
    for name, make in cases.items():
        args = make() or (tokens, labels, plan, count)
        try:
            train_step(model, opt, *args)
            out[name] = None
        except (ValueError, TypeError, RuntimeError) as err:
            out[name] = (type(err).__name__, str(err))
        dist.barrier()
    # one rank's parameters in another dtype (the model's activations then differ in dtype)
    if rank == 2:
        model.double()
    try:
        train_step(model, opt, tokens, labels, plan, count)
        out["one rank's model is float64"] = None
    except (ValueError, TypeError, RuntimeError) as err:
        out["one rank's model is float64"] = (type(err).__name__, str(err))
    return out



# ---- a step of several micro-batches: one check for all of them ------------------------------------


def micro_batch_checks(rank, world, mesh_shape, micro: int = 3):
    """``(cross-rank checks in one step of micro micro-batches, outcome of a step whose second micro-batch is
    bad on one rank)``: the step's inputs are checked together, once, before its first forward; a bad
    micro-batch stops every rank before any of the step's communication."""
    from flashpar.train.step import MicroBatch, optimizer_step

    mesh, model, opt = _model(mesh_shape, 2, "flash", "zero3", "flashcp")
    batch = [MicroBatch(*_inputs(mesh, seed, "flashcp")[:3]) for seed in range(micro)]
    count = float(sum(_inputs(mesh, seed, "flashcp")[3] for seed in range(micro)))
    optimizer_step(model, opt, batch, count)  # warm-up: the twin p2p groups
    dist.barrier()
    with Counting() as counting:
        optimizer_step(model, opt, batch, count)
    checks = counting.counts.get("meta", 0)
    bad = list(batch)
    if rank == 1:
        tokens, labels, plan = bad[1]
        bad[1] = MicroBatch(tokens[:-1], labels[:-1], plan)
    try:
        optimizer_step(model, opt, bad, count)
        outcome = None
    except (ValueError, TypeError, RuntimeError) as err:
        outcome = (type(err).__name__, str(err))
    return checks, outcome
