"""Segment attention: output and log-sum-exp of many (query range, key range) tasks, and its backward.

A task attends the query rows ``[q0, q1)`` of the local query tensor to the key rows ``[k0, k1)`` of
one key buffer (the rank's own K/V, or what one peer sent), either

* ``causal``: a square diagonal block, ``q1 - q0 == k1 - k0`` and query ``i`` sees keys ``0..i`` of
  the block (a document's piece against itself), or
* ``full``: every query sees every key (keys that lie before the query piece in its document), or
* ``band`` (sliding windows, ``flashpar.cp.window``): a full task's shape whose query ``i`` sees key ``j`` where
  ``0 <= delta + i - j < W`` (``band = (delta, W)``, ``delta`` the global position of the first query less that
  of the first key): an explicit mask over the task's slice of keys only.

For one task, with ``S = scale * Q K^T`` (masked) and per query row

    lse = log sum_k exp(S_k),        out = sum_k exp(S_k - lse) V_k.

Tasks over disjoint key sets of the same query rows are merged exactly by the log-sum-exp rule
(``merge``), so a query's attention can be assembled piece by piece as its K/V arrives.  The
backward of one task given the *merged* ``out`` and ``lse`` of its rows (as FlashAttention's
backward takes them) is that task's exact share of the gradient:

    P = exp(S - lse),   dV = P^T dO,   dP = dO V^T,   D = rowsum(dO * out),
    dS = P (dP - D),    dQ = scale dS K,   dK = scale dS^T Q,

and the shares add up over tasks to the gradient of the whole attention.

Batching: tasks of a phase with the same kind and similar lengths run as one padded batch (lengths
rounded up on a ladder of steps at most 1.25x, ``flashpar.cp.ladder``; above ``PAD_LIMIT`` only equal
lengths share a batch), so many short documents make a few kernel calls, not thousands.  Padding is
exact: query pads sit after the real queries (a causal query never sees a later key; pad outputs are
dropped and pad rows get zero gradient input), key pads of a full task are masked with ``-inf``.  A
causal batch is square (query and key lengths pad alike), so a causal kernel's alignment (upper-left
or lower-right) does not matter.

Backends:

* ``flash``, the default on CPU and on CUDA: one SDPA-class kernel call per batch, forward and
  backward.  On CPU torch's flash attention for CPU (``_scaled_dot_product_flash_attention_for_cpu``
  and its backward: GQA native, the key mask as ``attn_mask``, never a T x T matrix).  On CUDA torch's
  fused kernels that return the log-sum-exp (``flashpar.cp.sdpa_cuda``): FlashAttention-2
  (``_scaled_dot_product_flash_attention``: fp16 / bf16, GQA native, no mask) for every batch it can
  take, the memory-efficient kernel (``_scaled_dot_product_efficient_attention``: fp32, or a key-padded
  full batch through its additive bias; K/V heads expanded for GQA) for the rest.  Neither builds a
  score matrix, so memory stays linear in the chunk: at 128K tokens an explicit matrix per batch is not
  slower but impossible.  The calls are checked against the op schemas on the meta device and run on
  CPU against stand-ins of the kernels' documented semantics (``tests/test_cp_sdpa_cuda.py``);
  ``make gpu-check`` runs them against ``math`` on a GPU.
* ``math`` computes the same with explicit matrices per batch, on any device: the reference for
  tests, and the default where no fused kernel applies (devices other than CPU and CUDA; float64 on
  CUDA, which no fused CUDA kernel takes).
* ``varlen`` packs a phase's tasks of one kind without padding, with cumulative offsets, for
  FlashAttention-2's variable-length kernel on CUDA (``_flash_attention_forward`` /
  ``_flash_attention_backward``: one launch per phase and kind; fp16 and bf16, head dimension a
  multiple of 8 up to 256; the calls are checked against the op schemas on the meta device), and runs
  the same batches task by task with the CPU kernel elsewhere, which is how its packing is tested.
  Selectable by name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashpar.cp import sdpa_cuda
from flashpar.cp.ladder import PAD_LIMIT, padded_len  # noqa: F401 - PAD_LIMIT: the batching rule's, named here too


@dataclass(frozen=True)
class Task:
    q0: int
    q1: int
    buf: int  # -1: the rank's own K/V; otherwise the peer whose K/V buffer holds the keys
    k0: int
    k1: int
    causal: bool
    band: tuple[int, int] | None = None  # (delta, window): a band task (module docstring); None: causal or full


@dataclass
class Batch:
    """Tasks of one key buffer run by one kernel call.

    Direct form (one task): ``q_span`` / ``k_span`` slices, no copies.  Padded form: the batch is
    ``[B, Lq]`` queries and ``[B, Lk]`` keys; ``q_rows`` (local query rows) land at flat positions
    ``q_pos`` of ``B * Lq``, ``k_rows`` (buffer rows) at ``k_pos`` of ``B * Lk``; ``key_valid`` marks the
    real keys of a full batch with padded keys (``None``: no key is padded or the batch is causal).
    """

    causal: bool
    buf: int
    q_span: tuple[int, int] | None = None
    k_span: tuple[int, int] | None = None
    B: int = 1
    Lq: int = 0
    Lk: int = 0
    q_rows: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    k_rows: torch.Tensor | None = None
    k_pos: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None
    cu_q: torch.Tensor | None = None  # varlen form: int32 [B + 1] offsets of each task's packed queries
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    band: tuple[int, int] | None = None  # (delta, window) of every task of a band batch (their shapes are equal)

    @property
    def rows(self):
        """Local query rows of the batch: a slice (direct) or an index tensor (padded)."""
        return slice(*self.q_span) if self.q_span is not None else self.q_rows

    @property
    def keys(self):
        return slice(*self.k_span) if self.k_span is not None else self.k_rows

    def to(self, device: torch.device) -> Batch:
        if self.q_span is not None or self.q_rows.device == device:
            return self
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Batch(self.causal, self.buf, None, None, self.B, self.Lq, self.Lk, move(self.q_rows),
                     move(self.q_pos), move(self.k_rows), move(self.k_pos), move(self.key_valid),
                     move(self.cu_q), move(self.cu_k), self.max_q, self.max_k, self.band)


def make_batches(tasks: list[Task], varlen: bool = False) -> list[Batch]:
    """Group one phase's tasks into batches; within a batch every query row appears at most once.
    ``varlen``: one packed batch per (buffer, kind, layer), lengths as they are (cumulative offsets).  Band tasks
    share a batch only with tasks of the same shape and band (one mask serves the batch, nothing is padded), with
    or without ``varlen``."""
    groups: dict[tuple, list[Task]] = {}
    seen: dict[tuple, int] = {}
    for t in tasks:
        if t.band is not None:
            lq, lk = t.q1 - t.q0, t.k1 - t.k0
        else:
            lq, lk = (0, 0) if varlen else (padded_len(t.q1 - t.q0), padded_len(t.k1 - t.k0))
        # layer: how many earlier tasks of this buffer and kind share these query rows
        layer = seen.get((t.buf, t.causal, t.band, t.q0), 0)
        seen[(t.buf, t.causal, t.band, t.q0)] = layer + 1
        groups.setdefault((t.buf, t.causal, t.band, lq, lk, layer), []).append(t)
    out = []
    for (buf, causal, band, lq, lk, _), group in groups.items():
        if band is not None:
            out.append(_band_batch(buf, band, lq, lk, group))
            continue
        if varlen:
            out.append(_varlen_batch(buf, causal, group))
            continue
        if len(group) == 1:
            t = group[0]
            out.append(Batch(causal, buf, (t.q0, t.q1), (t.k0, t.k1)))
            continue
        q_rows, q_pos, k_rows, k_pos, valid = [], [], [], [], []
        for b, t in enumerate(group):
            q_rows.append(torch.arange(t.q0, t.q1))
            q_pos.append(torch.arange(b * lq, b * lq + t.q1 - t.q0))
            k_rows.append(torch.arange(t.k0, t.k1))
            k_pos.append(torch.arange(b * lk, b * lk + t.k1 - t.k0))
            valid.append(torch.arange(lk) < t.k1 - t.k0)
        key_valid = None if causal or all(t.k1 - t.k0 == lk for t in group) else torch.stack(valid)
        out.append(Batch(causal, buf, None, None, len(group), lq, lk, torch.cat(q_rows), torch.cat(q_pos),
                         torch.cat(k_rows), torch.cat(k_pos), key_valid))
    return out


def _band_batch(buf: int, band: tuple[int, int], lq: int, lk: int, group: list[Task]) -> Batch:
    """Band tasks of one shape and band: the direct form for one, else stacked without padding."""
    if len(group) == 1:
        t = group[0]
        return Batch(False, buf, (t.q0, t.q1), (t.k0, t.k1), band=band)
    q_rows = torch.cat([torch.arange(t.q0, t.q1) for t in group])
    k_rows = torch.cat([torch.arange(t.k0, t.k1) for t in group])
    return Batch(False, buf, None, None, len(group), lq, lk, q_rows, torch.arange(len(group) * lq), k_rows,
                 torch.arange(len(group) * lk), band=band)


def _varlen_batch(buf: int, causal: bool, group: list[Task]) -> Batch:
    lq = [t.q1 - t.q0 for t in group]
    lk = [t.k1 - t.k0 for t in group]
    offsets = lambda ls: torch.tensor([0, *ls], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # noqa: E731
    return Batch(causal, buf, None, None, len(group), 0, 0,
                 torch.cat([torch.arange(t.q0, t.q1) for t in group]), None,
                 torch.cat([torch.arange(t.k0, t.k1) for t in group]), None, None,
                 offsets(lq), offsets(lk), max(lq), max(lk))


# ----------------------------------------------------------------------------------------------
# assembling a batch's [B, H, L, D] operands and taking its results apart


def _pack(x: torch.Tensor, rows, pos, B: int, L: int) -> torch.Tensor:
    """Rows ``rows`` of ``x`` ([T, H, D] or [T, H]) at flat positions ``pos`` of a zeroed [B * L, ...]."""
    out = x.new_zeros((B * L, *x.shape[1:]))
    out[pos] = x[rows]
    return out


def _bhld(x: torch.Tensor, B: int) -> torch.Tensor:
    """[B * L, H, D] -> [B, H, L, D] (a view)."""
    return x.view(B, -1, *x.shape[1:]).transpose(1, 2)


def _rows_of(x: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    """[B, H, L, D] -> [B * L, H, D] rows at ``pos`` (all rows when ``pos`` is None)."""
    flat = x.transpose(1, 2).reshape(-1, *x.shape[1:2], *x.shape[3:])
    return flat if pos is None else flat[pos]


def _lse_rows(lse: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    """[B, H, L] -> [B * L, H] rows at ``pos``."""
    flat = lse.transpose(1, 2).reshape(-1, lse.shape[1])
    return flat if pos is None else flat[pos]


def _operands(batch: Batch, q, k, v):
    if batch.q_span is not None:
        qs, ks = batch.rows, batch.keys
        return _bhld(q[qs], 1), _bhld(k[ks], 1), _bhld(v[ks], 1)
    B = batch.B
    return (_bhld(_pack(q, batch.q_rows, batch.q_pos, B, batch.Lq), B),
            _bhld(_pack(k, batch.k_rows, batch.k_pos, B, batch.Lk), B),
            _bhld(_pack(v, batch.k_rows, batch.k_pos, B, batch.Lk), B))


def _mask(batch: Batch, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Additive key-padding mask [B, 1, 1, Lk] (0 for real keys, -inf for pads), or a band batch's band mask
    [1, 1, Lq, Lk] (:func:`band_mask`)."""
    if batch.band is not None:
        lq, lk = (batch.q_span[1] - batch.q_span[0], batch.k_span[1] - batch.k_span[0]) if batch.q_span else (
            batch.Lq, batch.Lk)
        return band_mask(lq, lk, *batch.band, dtype, device)
    if batch.key_valid is None:
        return None
    m = torch.zeros(batch.key_valid.shape, dtype=dtype, device=batch.key_valid.device)
    return m.masked_fill_(~batch.key_valid, -math.inf).view(batch.B, 1, 1, batch.Lk)


def band_mask(lq: int, lk: int, delta: int, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, lq, lk]: 0 where ``0 <= delta + i - j < window`` (query ``i`` sees key ``j``), else
    ``-inf``; built on ``device`` from the sizes alone (no host tensor, no copy)."""
    d = torch.arange(lq, device=device).unsqueeze(1) - torch.arange(lk, device=device) + delta
    seen = (d >= 0) & (d < window)
    return torch.zeros((lq, lk), dtype=dtype, device=device).masked_fill_(~seen, -math.inf).view(1, 1, lq, lk)


# ----------------------------------------------------------------------------------------------
# kernels on [B, H, L, D] operands


def _cpu_flash_fwd(q, k, v, causal, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=scale)


def _cpu_flash_bwd(dout, q, k, v, out, lse, causal, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


FLASH_KERNELS = {
    "cpu": (_cpu_flash_fwd, _cpu_flash_bwd),
    "cuda": (sdpa_cuda.forward, sdpa_cuda.backward),
    "meta": (sdpa_cuda.forward, sdpa_cuda.backward),  # torch's shape functions of the CUDA ops (tests check the calls)
}
"""The ``flash`` backend's (forward, backward) per device type, each taking ``[B, H, L, D]`` operands, the batch's
kind, its additive key mask (or ``None``) and the scale."""


def _flash_kernels(device: torch.device):
    try:
        return FLASH_KERNELS[device.type]
    except KeyError:
        raise ValueError(f"cp flash backend: no fused attention kernel on {device.type}; use backend='math'") from None


def _flash_fwd(q, k, v, causal, mask, scale):
    return _flash_kernels(q.device)[0](q, k, v, causal, mask, scale)


def _flash_bwd(dout, q, k, v, out, lse, causal, mask, scale):
    return _flash_kernels(q.device)[1](dout, q, k, v, out, lse, causal, mask, scale)


def _scores(q, k, causal, mask, scale):
    """Masked ``scale Q K^T`` [B, H, Lq, Lk] in float32 or better; GQA by repeating kv heads."""
    work = torch.promote_types(q.dtype, torch.float32)
    g = q.shape[1] // k.shape[1]
    s = scale * (q.to(work) @ k.to(work).repeat_interleave(g, 1).transpose(-1, -2))
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    if mask is not None:
        s = s + mask.to(work)
    return s


def _math_fwd(q, k, v, causal, mask, scale):
    s = _scores(q, k, causal, mask, scale)
    lse = s.logsumexp(-1)
    g = q.shape[1] // k.shape[1]
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.to(s.dtype).repeat_interleave(g, 1)
    return out.to(q.dtype), lse


def _math_bwd(dout, q, k, v, out, lse, causal, mask, scale):
    s = _scores(q, k, causal, mask, scale)
    work = s.dtype
    g = q.shape[1] // k.shape[1]
    p = torch.exp(s - lse.to(work).unsqueeze(-1))
    do, vv = dout.to(work), v.to(work).repeat_interleave(g, 1)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vv.transpose(-1, -2) - (do * out.to(work)).sum(-1, keepdim=True))
    dq = scale * ds @ k.to(work).repeat_interleave(g, 1)
    dk = scale * ds.transpose(-1, -2) @ q.to(work)
    fold = lambda x: x.unflatten(1, (k.shape[1], g)).sum(2)  # noqa: E731 - sum a kv head's query heads
    return dq.to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype)


VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # what FlashAttention-2's kernels take (flash_api.cpp)
VARLEN_DEVICES = ("cuda", "meta")  # meta: torch's shape functions of the same ops (tests check the calls on CPU)


def varlen_unsupported(dtype: torch.dtype, head_dim: int) -> str | None:
    """Why FlashAttention-2's variable-length kernel cannot take these operands (``None``: it can): it
    takes fp16 / bf16 only and head dimensions that are a multiple of 8, at most 256 (its
    ``TORCH_CHECK``s in ``mha_varlen_fwd`` / ``mha_varlen_bwd``; the meta functions do not check them)."""
    if dtype not in VARLEN_DTYPES:
        return f"it takes float16 or bfloat16, got {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"it takes a head dimension that is a multiple of 8 and at most 256, got {head_dim}"
    return None


def _check_varlen(q: torch.Tensor) -> None:
    why = varlen_unsupported(q.dtype, q.shape[-1])
    if why is not None:
        raise ValueError(f"cp varlen backend on {q.device.type}: FlashAttention-2's variable-length kernel cannot "
                         f"run these operands ({why}); use backend='flash' (the default)")


def _varlen_fwd(batch: Batch, q, k, v, scale):
    """Packed ``q`` [n, H, D], ``k``, ``v`` [m, H_kv, D] of a varlen batch -> out [n, H, D], lse [n, H].
    CUDA: FlashAttention-2's variable-length kernel, one launch (``aten::_flash_attention_forward``:
    ``(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
    *, scale)`` -> ``(output [n, H, D], softmax_logsumexp [H, n] float32, rng_state, unused,
    debug_attn_mask)``).  Elsewhere (tests) the same per task with the CPU flash kernel."""
    if q.device.type in VARLEN_DEVICES:
        _check_varlen(q)
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, batch.cu_q, batch.cu_k, batch.max_q, batch.max_k, 0.0, batch.causal, False, scale=scale)
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"cp varlen backend: log-sum-exp of shape {tuple(lse.shape)}, expected "
                               f"[heads, tokens] = {(q.shape[1], q.shape[0])}; use backend='math'")
        return out, lse.T
    outs, lses = [], []
    for (a, b), (c, d) in zip(_spans(batch.cu_q), _spans(batch.cu_k), strict=True):
        o, m = _cpu_flash_fwd(_bhld(q[a:b], 1), _bhld(k[c:d], 1), _bhld(v[c:d], 1), batch.causal, None, scale)
        outs.append(_rows_of(o, None))
        lses.append(_lse_rows(m, None))
    return torch.cat(outs), torch.cat(lses)


def _varlen_bwd(batch: Batch, dout, q, k, v, out, lse, scale):
    """Gradients of a varlen batch (packed operands; ``lse`` [n, H]).  CUDA:
    ``aten::_flash_attention_backward(grad_out, query, key, value, out, logsumexp [H, n] float32
    contiguous, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, rng_state, unused, *, scale)``
    -> ``(dq, dk, dv)`` in the operands' dtype; ``out`` and ``grad_out`` must have the operands' dtype."""
    if q.device.type in VARLEN_DEVICES:
        _check_varlen(q)
        # dropout 0: the kernel never reads the generator state; these have the shapes and dtype the forward returns
        # (uninitialised: CUDA has few uint64 kernels, and nothing reads them)
        rng = torch.empty(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty((), dtype=torch.uint64, device=q.device)
        return torch.ops.aten._flash_attention_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.T.to(torch.float32).contiguous(), batch.cu_q, batch.cu_k,
            batch.max_q, batch.max_k, 0.0, batch.causal, rng, unused, scale=scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (a, b), (c, d) in zip(_spans(batch.cu_q), _spans(batch.cu_k), strict=True):
        g = _cpu_flash_bwd(_bhld(dout[a:b], 1).contiguous(), _bhld(q[a:b], 1), _bhld(k[c:d], 1), _bhld(v[c:d], 1),
                       _bhld(out[a:b], 1).contiguous(), lse[a:b].T.unsqueeze(0).contiguous(), batch.causal, None,
                       scale)
        dq[a:b], dk[c:d], dv[c:d] = (_rows_of(x, None) for x in g)
    return dq, dk, dv


def _spans(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()
    return list(zip(c[:-1], c[1:], strict=True))


BACKENDS = {"flash": (_flash_fwd, _flash_bwd), "math": (_math_fwd, _math_bwd), "varlen": (_varlen_fwd, _varlen_bwd)}


CPU_DEFAULT_BACKEND = "flash"
CUDA_DEFAULT_BACKEND = "flash"
"""The backend ``attention`` and ``segment_attention`` use on CUDA when none is named: torch's fused SDPA kernels
per batch (FlashAttention-2, else the memory-efficient kernel: ``sdpa_cuda``), the path CPU runs with its own
flash kernel.  Never ``math`` there for the dtypes those kernels take (fp16, bf16, fp32): an explicit score matrix
per batch is quadratic in the chunk's memory.  ``make gpu-check`` reports whether it matched ``math`` on a GPU."""


def default_backend(device: torch.device, dtype: torch.dtype | None = None, head_dim: int | None = None) -> str:
    """The backend for operands on ``device`` (of ``dtype``, where known; ``head_dim`` changes nothing: the fused
    kernels pad it).  ``math`` only where no fused kernel applies: devices other than CPU and CUDA, and float64 on
    CUDA."""
    if device.type == "cpu":
        return CPU_DEFAULT_BACKEND
    if device.type == "cuda":
        return "math" if dtype is not None and sdpa_cuda.unsupported(dtype) else CUDA_DEFAULT_BACKEND
    return "math"


# ----------------------------------------------------------------------------------------------
# the primitive


def batch_forward(batch: Batch, q, k, v, scale: float, backend: str = "flash"):
    """``(rows, out_rows [n, H, D], lse_rows [n, H])`` of one batch (``k``, ``v``: its key buffer)."""
    if batch.cu_q is not None:
        out, lse = _varlen_fwd(batch, q[batch.q_rows], k[batch.k_rows], v[batch.k_rows], scale)
        return batch.q_rows, out, lse
    qb, kb, vb = _operands(batch, q, k, v)
    fwd = BACKENDS[_dense(backend)][0]
    out, lse = fwd(qb, kb, vb, batch.causal, _mask(batch, q.dtype, q.device), scale)
    return batch.rows, _rows_of(out, batch.q_pos), _lse_rows(lse, batch.q_pos)


def batch_backward(batch: Batch, q, k, v, dout, out, lse, scale: float, backend: str = "flash"):
    """``(dq_rows, dk_rows, dv_rows)`` of one batch given the merged ``out`` and ``lse`` of all local rows."""
    if batch.cu_q is not None:
        rows, keys = batch.q_rows, batch.k_rows
        return _varlen_bwd(batch, dout[rows], q[rows], k[keys], v[keys], out[rows], lse[rows], scale)
    qb, kb, vb = _operands(batch, q, k, v)
    if batch.q_span is not None:
        rows = batch.rows
        do_b, o_b, l_b = _bhld(dout[rows], 1), _bhld(out[rows], 1), lse[rows].T.unsqueeze(0)
    else:
        B, L, rows, pos = batch.B, batch.Lq, batch.q_rows, batch.q_pos
        do_b, o_b = _bhld(_pack(dout, rows, pos, B, L), B), _bhld(_pack(out, rows, pos, B, L), B)
        l_b = _pack(lse, rows, pos, B, L).view(B, L, -1).transpose(1, 2)
    dq, dk, dv = BACKENDS[_dense(backend)][1](do_b.contiguous(), qb, kb, vb, o_b.contiguous(), l_b.contiguous(),
                                              batch.causal, _mask(batch, q.dtype, q.device), scale)
    return _rows_of(dq, batch.q_pos), _rows_of(dk, batch.k_pos), _rows_of(dv, batch.k_pos)


def _dense(backend: str) -> str:
    """The backend of a batch in dense form: ``varlen`` packs no band batch (its kernel's window is aligned to the
    bottom-right diagonal of each task, a band task's is not): those run on the ``flash`` kernels."""
    return "flash" if backend == "varlen" else backend


def merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, rows, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold one task's ``(out, lse)`` into the running ``(acc_out, acc_lse)`` of its rows, in place:
    ``L = logaddexp(L_acc, lse)``, ``O = O_acc exp(L_acc - L) + out exp(lse - L)``."""
    old = acc_lse[rows]
    new = torch.logaddexp(old, lse.to(old.dtype))
    acc_out[rows] = (acc_out[rows] * torch.exp(old - new).unsqueeze(-1)
                     + out.to(acc_out.dtype) * torch.exp(lse.to(old.dtype) - new).unsqueeze(-1))
    acc_lse[rows] = new


def segment_attention(q: torch.Tensor, bufs: dict[int, tuple[torch.Tensor, torch.Tensor]], tasks: list[Task],
                      scale: float | None = None, backend: str | None = None):
    """Forward of a set of tasks over key buffers ``bufs`` (``-1``: own K/V): merged ``(out, lse)`` of every
    query row (rows no task touches get out 0 and lse -inf).  No autograd: see ``batch_backward``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    backend = backend or default_backend(q.device, q.dtype, q.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=acc, device=q.device)
    for batch in make_batches(tasks, varlen=backend == "varlen"):
        k, v = bufs[batch.buf]
        rows, o, m = batch_forward(batch.to(q.device), q, k, v, scale, backend)
        merge(out, lse, rows, o, m)
    return out, lse
