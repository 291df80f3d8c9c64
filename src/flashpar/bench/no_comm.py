"""``no_comm()``: every torch.distributed collective and point-to-point call becomes a local no-op.

``flashpar bench train`` times each configuration twice, as it is and inside ``no_comm()``; the
difference is the communication the step leaves exposed.  Inside the block:

    c10d (torch.distributed)           fake                                   returns
    all_reduce, broadcast              nothing (the tensor keeps its values)  a done Work
    all_gather[_into_tensor|_single]   every rank's slot = this rank's input  a done Work
    reduce_scatter[_tensor|_single]    output = this rank's input rows        a done Work
    all_to_all[_single]                output = input (zeros if sizes differ) a done Work
    isend / send, irecv / recv         nothing / the buffer zeroed            a done Work
    batch_isend_irecv                  the receive buffers zeroed             [a done Work]
    functional (DTensor, FSDP hooks)   all_gather_* = cat(n x input),         plain tensors
                                       reduce_scatter_* = the first 1/n,
                                       all_reduce / all_to_all = a copy

Outputs have the right shapes and finite values (copies of local data, never uninitialised
memory, which can hold NaN or denormals that change the compute's speed), so the step runs the
same kernels on the same shapes; its numbers are meaningless.  The copies stand in for what the
transport writes on arrival.  ``barrier`` stays real (the bench times with barriers); the
``*_object`` calls are built on the faked ones, so gather samples outside the block.

How it patches: every loaded module of ``torch.distributed`` and ``flashpar`` whose attribute *is*
one of the originals (``from torch.distributed import isend`` and ``flashpar.dist.all_gather_single
= dist.all_gather_single`` both bind the function object) gets the fake for the block, so calls made
through any name (and from any thread, e.g. flashpar's lanes) are caught.  The fakes are global,
not per thread: use the block only while nothing else talks to the process group.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d


class DoneWork:
    """A ``Work`` that is already complete."""

    def wait(self, *args, **kwargs) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def synchronize(self) -> None:
        return None

    def get_future(self):
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut


def _arg(args, kwargs, i: int, *names: str):
    if len(args) > i:
        return args[i]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return None


def _done(args, kwargs, i: int):
    """A done Work when the call asked for ``async_op`` (argument ``i``), else ``None`` like the real call."""
    return DoneWork() if _arg(args, kwargs, i, "async_op") else None


def _fill_rows(out: torch.Tensor, inp: torch.Tensor) -> None:
    """``out`` (flat size ``n * inp.numel()`` or less) filled with repeats of ``inp``."""
    flat, src = out.reshape(-1), inp.reshape(-1)
    if src.numel() == 0:
        return
    if src.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        src = src.clone()  # an in-place gather (FSDP2: the input is this rank's slot of the output)
    reps = flat.numel() // src.numel()
    if reps:
        flat[: reps * src.numel()].view(reps, -1).copy_(src)
    rest = flat.numel() - reps * src.numel()
    if rest:
        flat[-rest:].copy_(src[:rest])


def _copy_or_zero(out: torch.Tensor, inp: torch.Tensor) -> None:
    if out.numel() == inp.numel():
        out.copy_(inp.reshape(out.shape))
    else:
        out.zero_()


# ---- c10d fakes (signatures as torch.distributed's) -------------------------------------------


def _all_reduce(*args, **kwargs):
    return _done(args, kwargs, 3)


def _broadcast(*args, **kwargs):
    return _done(args, kwargs, 3)


def _all_gather(tensor_list, tensor, *args, **kwargs):
    for t in tensor_list:
        t.copy_(tensor)
    return _done((tensor_list, tensor, *args), kwargs, 3)


def _all_gather_into(output, input, *args, **kwargs):  # noqa: A002 - torch's names
    _fill_rows(output, input)
    return _done((output, input, *args), kwargs, 3)


def _reduce_scatter_into(output, input, *args, **kwargs):  # noqa: A002
    output.copy_(input.reshape(-1)[: output.numel()].view(output.shape))
    return _done((output, input, *args), kwargs, 4)


def _reduce_scatter_list(output, input_list, *args, **kwargs):
    _copy_or_zero(output, input_list[0])
    return _done((output, input_list, *args), kwargs, 4)


def _all_to_all_single(output, input, *args, **kwargs):  # noqa: A002
    _copy_or_zero(output, input)
    return _done((output, input, *args), kwargs, 5)


def _all_to_all(output_list, input_list, *args, **kwargs):
    for o, i in zip(output_list, input_list, strict=False):
        _copy_or_zero(o, i)
    return _done((output_list, input_list, *args), kwargs, 3)


def _isend(tensor, *args, **kwargs):
    return DoneWork()


def _irecv(tensor, *args, **kwargs):
    tensor.zero_()
    return DoneWork()


def _send(tensor, *args, **kwargs):
    return None


def _recv(tensor, *args, **kwargs):
    tensor.zero_()
    return 0


def _batch_isend_irecv(p2p_op_list):
    for op in p2p_op_list:
        if op.op in (_irecv, _ORIGINAL.get("irecv")):
            op.tensor.zero_()
    return [DoneWork()] if p2p_op_list else []


# ---- functional-collective fakes ---------------------------------------------------------------


def _group_size(group) -> int:
    return c10d._get_group_size_by_name(funcol._resolve_group_name(group))


def _f_all_reduce(self, reduceOp, group, tag: str = ""):
    return self.clone()


def _f_all_gather(self, gather_dim, group, tag: str = ""):
    return torch.cat([self] * _group_size(group), dim=gather_dim)


def _f_reduce_scatter(self, reduceOp, scatter_dim, group, tag: str = ""):
    return self.narrow(scatter_dim, 0, self.shape[scatter_dim] // _group_size(group)).clone()


def _f_all_to_all(self, output_split_sizes, input_split_sizes, group, tag: str = ""):
    if output_split_sizes is None or list(output_split_sizes) == list(input_split_sizes or output_split_sizes):
        return self.clone()
    return self.new_zeros((sum(output_split_sizes), *self.shape[1:]))


def _f_wait(tensor):
    return tensor


_C10D_FAKES = {
    "all_reduce": _all_reduce, "broadcast": _broadcast, "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into, "all_gather_single": _all_gather_into,
    "_all_gather_base": _all_gather_into, "reduce_scatter_tensor": _reduce_scatter_into,
    "reduce_scatter_single": _reduce_scatter_into, "_reduce_scatter_base": _reduce_scatter_into,
    "reduce_scatter": _reduce_scatter_list, "all_to_all_single": _all_to_all_single, "all_to_all": _all_to_all,
    "isend": _isend, "irecv": _irecv, "send": _send, "recv": _recv, "batch_isend_irecv": _batch_isend_irecv,
}
_FUNCOL_FAKES = {
    "all_reduce": _f_all_reduce, "all_gather_single": _f_all_gather, "all_gather_single_autograd": _f_all_gather,
    "all_gather_tensor": _f_all_gather, "all_gather_tensor_autograd": _f_all_gather,
    "reduce_scatter_single": _f_reduce_scatter, "reduce_scatter_single_autograd": _f_reduce_scatter,
    "reduce_scatter_tensor": _f_reduce_scatter, "reduce_scatter_tensor_autograd": _f_reduce_scatter,
    "all_to_all_single": _f_all_to_all, "all_to_all_single_autograd": _f_all_to_all, "wait_tensor": _f_wait,
}
_ORIGINAL: dict[str, object] = {}  # c10d name -> original function (for batch_isend_irecv's irecv test)


def _fakes() -> dict[int, object]:
    """id(original function) -> its fake."""
    out = {}
    for table, module in ((_C10D_FAKES, c10d), (_FUNCOL_FAKES, funcol)):
        for name, fake in table.items():
            original = getattr(module, name, None)
            if original is not None:
                out[id(original)] = fake
                if module is c10d:
                    _ORIGINAL[name] = original
    return out


def _bindings(fakes: dict[int, object]) -> list[tuple[object, str, object]]:
    """(module, attribute, original) of every loaded torch.distributed / flashpar module attribute bound to
    an original."""
    found = []
    for mod_name, module in list(sys.modules.items()):
        if module is None or not mod_name.startswith(("torch.distributed", "flashpar")):
            continue
        for attr, value in list(vars(module).items()):
            if callable(value) and id(value) in fakes:
                found.append((module, attr, value))
    return found


@contextlib.contextmanager
def no_comm() -> Iterator[None]:
    """Inside the block every collective and p2p call of torch.distributed is a local no-op (module docstring)."""
    fakes = _fakes()
    bound = _bindings(fakes)
    try:
        for module, attr, original in bound:
            setattr(module, attr, fakes[id(original)])
        yield
    finally:
        for module, attr, original in bound:
            setattr(module, attr, original)


def communicating() -> bool:
    """False inside ``no_comm()`` (the c10d ``all_reduce`` is the fake)."""
    return dist.all_reduce is not _all_reduce
