"""Where a training step's time goes, measured around the real calls on every rank: ``breakdown()``.

Inside the block a clock stack runs: every interval of wall time belongs to the innermost open part,
and the part's total is the time it was innermost (exclusive), so the parts add up to the wall time
of the block:

    part           opened around
    attention_fwd  the attention kernels' forward ops (torch's CPU flash kernel, which flashpar's segment
                   kernels and the torch peer both call; FlashAttention / efficient / flex on CUDA)
    attention_bwd  their backward ops
    linear         the GEMM ops (mm, addmm, bmm, baddbmm), forward and backward
    loss           the cross-entropy ops (log-softmax, nll, and their backward); flashpar's vocabulary-parallel
                   loss (``flashpar.models.vocab.vocab_parallel_loss``, written in elementwise ops) from
                   its call to its return, and in backward from its result's gradient to its logits'
                   (two identity autograd markers)
    optimizer      ``optimizer.step`` and ``zero_grad`` (every op inside them)
    exposed_comm   every collective and point-to-point call of torch.distributed (c10d, the functional
                   collectives DTensor and FSDP2 call, their ops in backward) and every wait on a
                   ``Work`` one returned: the time the step is blocked in communication
    elementwise    every other op (norms, activations, rope, copies, views, embedding, the merge of
                   attention pieces); a compiled region of flashpar's (``timed_regions``) from its call
                   to its return, and its backward node from start to end
    other          what no op covers: Python, autograd's engine, DTensor's and FSDP2's bookkeeping
                   between ops, hooks
    (a region)     a named call of the caller's (``breakdown(regions={function: part})``: inference's
                   ``planning``, ``setup`` and ``logits``) from its call to its return, every op inside it
                   but communication counted for it

The ops are seen by a ``TorchDispatchMode`` (below autograd: the ops that run, forward and backward,
on the thread that steps); the calls by the same re-binding ``no_comm`` uses.  A functional
collective is waited for inside its call (DTensor and FSDP2 use the result right away on CPU; the
wait would otherwise land in the op that first reads it).  Communication on other threads (flashpar's
lanes) is counted only where the stepping thread waits for it: the clock moves only on the thread that
opened the block (a lane's worker posting through a re-bound call leaves it alone).  The mode's own cost (a Python call
per op) falls in the parts; a step measured here is compared with the same step timed without it.

    stack:  other ─┬─ linear ── ... ─┬─ optimizer ─┬─ exposed_comm
                   │ (t spent here   │ (its ops     │ (a reduce inside
                   │  counts for     │  count for   │  the step counts
                   │  linear only)   │  optimizer)  │  for comm)
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

PARTS = ("attention_fwd", "attention_bwd", "linear", "elementwise", "loss", "optimizer", "exposed_comm", "other")

_ATTN_FWD = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_flash_attention_forward", "_efficient_attention_forward", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "flex_attention", "_varlen_attn", "_fused_sdp_choice"}
_ATTN_BWD = {"_scaled_dot_product_flash_attention_for_cpu_backward", "_scaled_dot_product_flash_attention_backward",
             "_flash_attention_backward", "_efficient_attention_backward",
             "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_cudnn_attention_backward",
             "flex_attention_backward", "_varlen_attn_backward"}
_LINEAR = {"mm", "addmm", "bmm", "baddbmm", "_addmm_activation"}
_LOSS = {"_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward", "nll_loss2d_forward",
         "nll_loss2d_backward"}
_COMM_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"}
_STICKY = {"optimizer", "exposed_comm", "loss"}  # parts whose ops count for them, whatever the op


def part_of(func) -> str:
    """The part an op counts for (module docstring)."""
    namespace = getattr(func, "namespace", "aten")
    if namespace in _COMM_NAMESPACES:
        return "exposed_comm"
    name = func.__name__.split(".")[0] if hasattr(func, "__name__") else str(func)
    if name in _ATTN_FWD:
        return "attention_fwd"
    if name in _ATTN_BWD:
        return "attention_bwd"
    if name in _LINEAR:
        return "linear"
    if name in _LOSS:
        return "loss"
    return "elementwise"


class Clock:
    """The exclusive clock stack: ``enter(part)`` / ``leave()``; ``ms[part]`` the time each part was innermost,
    ``cpu_ms[part]`` the stepping thread's CPU time in it (``time.thread_time``: where ranks share cores, the
    work a part did, without the time it waited for a core), ``entries[part]`` how many times it was entered
    (ops, calls, markers: what a test can check exactly).
    ``regions``: parts besides ``PARTS`` (named calls), sticky as ``loss``.  Only the thread that made the clock
    moves it."""

    def __init__(self, regions: tuple[str, ...] = ()) -> None:
        self.parts = PARTS + tuple(p for p in dict.fromkeys(regions) if p not in PARTS)
        self.sticky = _STICKY | set(regions)
        self.thread = threading.get_ident()
        self.stack = ["other"]
        self.restart()

    def restart(self) -> None:
        """Zero every part and start the wall clock now: what ran before (entering the block) is not counted."""
        self.ms = dict.fromkeys(self.parts, 0.0)
        self.cpu_ms = dict.fromkeys(self.parts, 0.0)
        self.entries = dict.fromkeys(self.parts, 0)
        self.last_cpu = time.thread_time()
        self.last = self.started = time.perf_counter()

    def _switch(self) -> None:
        now, cpu = time.perf_counter(), time.thread_time()
        top = self.stack[-1]
        self.ms[top] += 1e3 * (now - self.last)
        self.cpu_ms[top] += 1e3 * (cpu - self.last_cpu)
        self.last, self.last_cpu = now, cpu

    def enter(self, part: str) -> None:
        if threading.get_ident() != self.thread:
            return
        self._switch()
        self.entries[part] += 1
        self.stack.append(part)

    def leave(self) -> None:
        if threading.get_ident() != self.thread:
            return
        self._switch()
        self.stack.pop()

    def top(self) -> str:
        return self.stack[-1]

    def finish(self) -> dict[str, float]:
        """The parts, and ``wall_ms``: the time from ``restart`` to now, read from the same clock reads the parts
        were cut from, so the parts add up to it (each interval counted once, for the innermost part)."""
        self._switch()
        return {**self.ms, "wall_ms": 1e3 * (self.last - self.started)}


@contextlib.contextmanager
def opened(clock: Clock, part: str) -> Iterator[None]:
    clock.enter(part)
    try:
        yield
    finally:
        clock.leave()


class _OpMode(TorchDispatchMode):
    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        part = part_of(func)
        if self.clock.top() in self.clock.sticky and part != "exposed_comm":
            part = self.clock.top()
        with opened(self.clock, part):
            return func(*args, **(kwargs or {}))


class _TimedWork:
    """A ``Work`` whose waits count for exposed_comm."""

    def __init__(self, work, clock: Clock) -> None:
        self._work, self._clock = work, clock

    def wait(self, *args, **kwargs):
        with opened(self._clock, "exposed_comm"):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


def _wrap_c10d(original, clock: Clock):
    def call(*args, **kwargs):
        with opened(clock, "exposed_comm"):
            out = original(*args, **kwargs)
        if isinstance(out, list):
            return [_TimedWork(w, clock) if hasattr(w, "wait") else w for w in out]
        return _TimedWork(out, clock) if out is not None and hasattr(out, "wait") else out

    return call


def _wrap_funcol(original, clock: Clock):
    def call(*args, **kwargs):
        with opened(clock, "exposed_comm"):
            out = original(*args, **kwargs)
            if isinstance(out, funcol.AsyncCollectiveTensor):
                out = out.wait()
            return out

    return call


_C10D_NAMES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "_all_gather_base", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
               "reduce_scatter", "all_to_all_single", "all_to_all", "isend", "irecv", "send", "recv",
               "batch_isend_irecv", "barrier")
_FUNCOL_NAMES = ("all_reduce", "all_gather_single", "all_gather_single_autograd", "all_gather_tensor",
                 "all_gather_tensor_autograd", "reduce_scatter_single", "reduce_scatter_single_autograd",
                 "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "all_to_all_single",
                 "all_to_all_single_autograd", "wait_tensor")


class _Marker(torch.autograd.Function):
    """Identity that remembers a clock and a part for its backward (the two markers below)."""

    @staticmethod
    def forward(ctx, x, clock, part):
        ctx.clock, ctx.part = clock, part
        return x.view_as(x)


class _OpenInBackward(_Marker):
    """Identity; its backward opens ``part`` (put on a region's output: backward reaches it first)."""

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.enter(ctx.part)
        return grad, None, None


class _CloseInBackward(_Marker):
    """Identity; its backward closes ``part`` if it is the innermost (put on a region's input)."""

    @staticmethod
    def backward(ctx, grad):
        if ctx.clock.top() == ctx.part:
            ctx.clock.leave()
        return grad, None, None


def _wrap_loss(original, clock: Clock):
    def call(logits, *args, **kwargs):
        with opened(clock, "loss"):
            if logits.requires_grad:
                logits = _CloseInBackward.apply(logits, clock, "loss")
            out = original(logits, *args, **kwargs)
            return _OpenInBackward.apply(out, clock, "loss") if out.requires_grad else out

    return call


def _wrap_region(original, clock: Clock, part: str):
    @functools.wraps(original)
    def call(*args, **kwargs):
        with opened(clock, part):
            return original(*args, **kwargs)

    return call


def _wrappers(clock: Clock, regions: dict) -> dict[int, object]:
    from flashpar.models import vocab

    out = {id(vocab.vocab_parallel_loss): _wrap_loss(vocab.vocab_parallel_loss, clock)}
    out.update({id(fn): _wrap_region(fn, clock, part) for fn, part in regions.items()})
    for names, module, wrap in ((_C10D_NAMES, c10d, _wrap_c10d), (_FUNCOL_NAMES, funcol, _wrap_funcol)):
        for name in names:
            original = getattr(module, name, None)
            if original is not None:
                out[id(original)] = wrap(original, clock)
    return out


def timed_regions(regions, clock: Clock):
    """``regions`` (``flashpar.models.regions.Regions``) with every call counted for ``elementwise`` (the loss's for
    ``loss``): a compiled
    region runs as inductor's kernels, which the dispatch mode does not see, and dynamo runs no compiled frame
    while the mode is set, so each call runs with the mode set aside, its forward timed from call to return and
    its backward node (the compiled graph's) from its start to its end, by hooks on that node."""
    import dataclasses

    from torch.utils._python_dispatch import _disable_current_modes

    def wrap(fn, part: str):
        def enter(_grads):
            clock.enter(part)

        def leave(_grad_inputs, _grad_outputs):
            if clock.top() == part:
                clock.leave()

        @functools.wraps(fn)
        def call(*args):
            with opened(clock, part), _disable_current_modes():
                out = fn(*args)
            outs = out if isinstance(out, tuple) else (out,)
            for node in {t.grad_fn for t in outs if t.grad_fn is not None}:
                if "CompiledFunction" in node.name():  # the graph's backward (a view of an output has its own)
                    node.register_prehook(enter)
                    node.register_hook(leave)
            return out

        return call

    names = [f.name for f in dataclasses.fields(regions) if f.name != "compiled"]  # every region, the loss's too
    return dataclasses.replace(regions, **{name: wrap(getattr(regions, name), "loss" if name == "loss_sums"
                                                      else "elementwise") for name in names})


@contextlib.contextmanager
def timed_model(model, clock):
    """A compiled flashpar model's regions counted for ``elementwise`` while the breakdown runs
    (``flashpar.bench.breakdown.timed_regions``); any other model as it is."""
    if not getattr(getattr(model, "options", None), "compile", False):
        yield
        return
    holders = [model, *model.blocks]
    kept = [h.regions for h in holders]
    try:
        for h in holders:
            h.regions = timed_regions(h.regions, clock)
        yield
    finally:
        for h, r in zip(holders, kept, strict=True):
            h.regions = r


@contextlib.contextmanager
def breakdown(optimizers=(), regions: dict | None = None) -> Iterator[Clock]:
    """Measure the block's wall time by part (module docstring); ``optimizers``' ``step`` and ``zero_grad`` count
    as ``optimizer``; ``regions`` ``{function: part}``: every call of a module-level function of torch.distributed
    or flashpar (through any module that binds it) counts for its part.  Inside the block: ``clock.restart()``
    just before the step (the block's own entry left out), ``clock.finish()`` just after it.  One block at a time,
    on the stepping thread."""
    from flashpar.bench.no_comm import _bindings

    regions = regions or {}
    clock = Clock(tuple(regions.values()))
    wrappers = _wrappers(clock, regions)
    bound = _bindings(wrappers)
    patched = []
    for opt in optimizers:
        for name in ("step", "zero_grad"):
            method = getattr(opt, name)

            def timed(*args, _method=method, **kwargs):
                with opened(clock, "optimizer"):
                    return _method(*args, **kwargs)

            setattr(opt, name, timed)
            patched.append((opt, name))
    try:
        for module, attr, original in bound:
            setattr(module, attr, wrappers[id(original)])
        with _OpMode(clock):
            yield clock
    finally:
        for module, attr, original in bound:
            setattr(module, attr, original)
        for opt, name in patched:
            delattr(opt, name)  # the class's method again
