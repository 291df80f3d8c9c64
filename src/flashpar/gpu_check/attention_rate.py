"""Part ``attention``: TFLOP/s of the CP segment-attention backends against dense FlashAttention.

A case is one rank's attention work of a real pack: a sequence of ``tokens`` tokens packed from a
shipped length list (``flashpar.cp.lengths``), planned with ``flashcp`` over ``cp`` ranks; the rank's
tasks (``flashpar.cp.layout``: its own K/V first, then each peer's, here random tensors of the sizes
the plan sends) run exactly as ``cp.attention`` runs them, merge and gradient accumulation included,
for each backend of ``flashpar.cp.kernels`` the device has.  Useful FLOPs count only the (query, key)
pairs the causal document mask allows (a causal task of length L: L (L + 1) / 2 pairs; a full task
Lq Lk), never padding:

    forward FLOPs  = 4 pairs H D          (S = Q K^T and O = P V)
    backward FLOPs = 10 pairs H D         (S again, dV, dP, dQ, dK: 2.5x the forward, as FlashAttention counts)

The reference is dense causal attention through SDPA's flash backend over ``L`` tokens with about the
same useful pairs (``L = sqrt(2 pairs)``, one sequence), timed the same way; ``vs dense`` is the
backend's TFLOP/s over the reference's.  ``predicted`` is the cost model's rate for the same tasks
(``Hardware.attn_time`` per task and a launch per kernel call of the default backend, the device's
preset), so a calibration can be read off the table.
The ``math`` backend builds every batch's score matrix; batches that would need more than
``MATH_LIMIT_BYTES`` are not run (the row says so).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from flashpar import cost as costs
from flashpar.cp import kernels
from flashpar.cp import plan as make_plan
from flashpar.cp.exchange import add_rows
from flashpar.cp.layout import device_layout, rank_layout
from flashpar.cp.lengths import resolve_lengths

MATH_LIMIT_BYTES = 90e9  # score matrices of the math backend (six float32 [B, H, Lq, Lk] copies at most; H200: 139 GB)


@dataclass(frozen=True)
class Case:
    lengths: str  # a shipped length list
    tokens: int  # of the pack
    cp: int  # ranks of the plan; the rank timed is ``rank``
    rank: int = -1  # -1: the rank that receives the most K/V (a Whole-Doc rank would receive none)
    scale: int = 1  # document lengths divided by this (tiny runs)

    @property
    def label(self) -> str:
        where = "whole pack" if self.cp == 1 else f"busiest receiver of cp {self.cp}"
        return f"{self.lengths} {self.tokens // 1024}K, {where}" if self.tokens >= 1024 else \
            f"{self.lengths} {self.tokens}, {where}"


@dataclass(frozen=True)
class Sizes:
    cases: tuple[Case, ...]
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    reps: int


FULL = Sizes((Case("spamassassin", 32768, 1), Case("prolong", 131072, 1), Case("wlbllm", 131072, 1),
              Case("wlbllm", 131072, 8)),
             heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, reps=5)  # Llama 3 8B's attention heads
TINY = Sizes((Case("sotu", 512, 1, scale=32), Case("sotu", 512, 2, scale=32)),
             heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, reps=2)


def backends_for(device: torch.device) -> tuple[str, ...]:
    """Every backend, ``math`` first (the reference): ``flash`` is torch's CPU flash kernel on the CPU and its fused
    SDPA kernels on CUDA (the default on both); ``varlen`` FlashAttention-2's variable-length kernel on CUDA."""
    return ("math", "flash", "varlen")


def useful_pairs(layout) -> int:
    """(query, key) pairs of a rank's tasks, from its varlen layout (every task exactly, no padding)."""
    total = 0
    for phase in layout.phases:
        for b in phase:
            lq, lk = b.cu_q.diff().tolist(), b.cu_k.diff().tolist()
            total += sum(q * (q + 1) // 2 if b.causal else q * k for q, k in zip(lq, lk, strict=True))
    return total


def predicted_seconds(layout, hw: costs.Hardware, heads: int, head_dim: int, factor: float, calls: int = 0) -> float:
    """The cost model's time of the rank's tasks: ``attn_time`` per task, ``factor`` FLOPs per pair and head dim, and
    one launch (``gemm_overhead_s``) per kernel call of the default backend (``calls``: its batches)."""
    total = calls * hw.gemm_overhead_s
    for phase in layout.phases:
        for b in phase:
            for q, k in zip(b.cu_q.diff().tolist(), b.cu_k.diff().tolist(), strict=True):
                pairs = q * (q + 1) // 2 if b.causal else q * k
                total += hw.attn_time(factor * pairs * heads * head_dim, q, k)
    return total


def math_bytes(phases, heads: int) -> float:
    """The largest batch's score matrices for the math backend (six float32 copies of [B, H, Lq, Lk])."""
    worst = 0
    for phase in phases:
        for b in phase:
            if b.q_span is not None:
                size = (b.q_span[1] - b.q_span[0]) * (b.k_span[1] - b.k_span[0])
            else:
                size = b.B * b.Lq * b.Lk
            worst = max(worst, size)
    return 6 * 4 * heads * worst


def forward(phases, q, bufs, scale, backend):
    """Merged ``(out, lse)`` of every batch of every phase (what ``cp.attention``'s forward computes)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:2], -math.inf, dtype=acc, device=q.device)
    for phase in phases:
        for b in phase:
            rows, o, m = kernels.batch_forward(b, q, *bufs[b.buf], scale, backend)
            kernels.merge(out, lse, rows, o, m)
    return out, lse


def backward(phases, q, bufs, dout, out, lse, scale, backend):
    """Gradients of q and of every key buffer (what ``cp.attention``'s backward accumulates)."""
    acc = lse.dtype
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    grads = {o: (torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device))
             for o, (k, v) in bufs.items()}
    for phase in phases:
        for b in phase:
            a, gk, gv = kernels.batch_backward(b, q, *bufs[b.buf], dout, out, lse, scale, backend)
            add_rows(dq, b.rows, a)
            add_rows(grads[b.buf][0], b.keys, gk)
            add_rows(grads[b.buf][1], b.keys, gv)
    return dq, grads


def dense_rate(pairs: int, sizes: Sizes, device: torch.device, cap: int, gen, budget_s: float) -> dict:
    """Dense causal attention over ``L = sqrt(2 pairs)`` tokens (a multiple of 128, at most ``cap``)
    through SDPA's flash backend: forward and backward seconds and TFLOP/s of its L (L + 1) / 2 pairs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    length = max(128, min(cap, round(math.sqrt(2 * pairs) / 128) * 128))
    h, hkv, d = sizes.heads, sizes.kv_heads, sizes.head_dim
    mk = lambda n: torch.randn(1, n, length, d, device=device, dtype=sizes.dtype, generator=gen)  # noqa: E731
    q, k, v = (mk(n).requires_grad_() for n in (h, hkv, hkv))
    dout, note = mk(h), "GQA"
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            sdpa(q, k, v, is_causal=True, enable_gqa=True)
        except RuntimeError:  # this flash kernel takes no grouped kv heads: each kv head repeated (the same FLOPs)
            k, v = (x.detach().repeat_interleave(h // hkv, 1).requires_grad_() for x in (k, v))
            note = "kv heads repeated"
        fwd = lambda: sdpa(q, k, v, is_causal=True, enable_gqa=k.shape[1] != h)  # noqa: E731
        t_fwd = _timed(fwd, device, sizes, budget_s / 2)
        t_both = _timed(lambda: fwd().backward(dout), device, sizes, budget_s / 2)
    dense_pairs = length * (length + 1) // 2
    t_bwd = max(t_both - t_fwd, 1e-9)
    return {"tokens": length, "pairs": dense_pairs, "fwd_ms": 1e3 * t_fwd, "bwd_ms": 1e3 * t_bwd, "note": note,
            "fwd_tflops": 4 * dense_pairs * h * d / t_fwd / 1e12, "bwd_tflops": 10 * dense_pairs * h * d / t_bwd / 1e12}


def _timed(fn, device, sizes: Sizes, budget_s: float) -> float:
    from flashpar.gpu_check.timing import median_seconds

    return median_seconds(fn, device, warmup=1, reps=sizes.reps, budget_s=budget_s)


def run_case(case: Case, sizes: Sizes, device: torch.device, hw: costs.Hardware, budget_s: float) -> dict:
    lens = resolve_lengths(case.lengths).packs(case.tokens, 1, scale=case.scale)[0]
    plan = make_plan(lens, case.cp, strategy="flashcp")
    rank = case.rank if case.rank >= 0 else max(range(case.cp), key=lambda r: sum(
        rank_layout(plan, r).recv_tokens(o) for o in range(case.cp)))
    case = dataclasses.replace(case, rank=rank)
    layout = rank_layout(plan, case.rank, True)
    pairs = useful_pairs(layout)
    h, hkv, d = sizes.heads, sizes.kv_heads, sizes.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    mk = lambda n, heads: torch.randn(n, heads, d, device=device, dtype=sizes.dtype, generator=gen)  # noqa: E731
    q = mk(layout.tokens, h)
    bufs = {-1: (mk(layout.tokens, hkv), mk(layout.tokens, hkv))}
    bufs.update({o: (mk(layout.recv_tokens(o), hkv), mk(layout.recv_tokens(o), hkv))
                 for o in range(case.cp) if o != case.rank and layout.recv_tokens(o) > 0})
    dout = mk(layout.tokens, h)
    scale = d ** -0.5
    fwd_flops, bwd_flops = 4 * pairs * h * d, 10 * pairs * h * d
    calls = sum(len(p) for p in rank_layout(plan, case.rank).phases)  # the default backend's batches
    row = {"case": case.label, "rank": rank, "documents": len(lens), "longest": max(lens),
           "local_tokens": layout.tokens,
           "received_tokens": sum(layout.recv_tokens(o) for o in bufs if o != -1), "pairs": pairs,
           "fwd_gflop": fwd_flops / 1e9, "backends": [],
           "predicted_fwd_tflops": fwd_flops / predicted_seconds(layout, hw, h, d, 4, calls) / 1e12,
           "predicted_bwd_tflops": bwd_flops / predicted_seconds(layout, hw, h, d, 10, calls) / 1e12}
    t0 = time.perf_counter()
    share = budget_s / (len(backends_for(device)) + 1)
    reference = None
    for backend in backends_for(device):
        row["backends"].append(_backend_row(backend, plan, case, q, bufs, dout, scale, sizes, device, hw, share,
                                            fwd_flops, bwd_flops, reference))
        if backend == "math" and "out" in row["backends"][-1]:
            reference = row["backends"][-1].pop("out")
        row["backends"][-1].pop("out", None)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    try:
        left = max(1.0, budget_s - (time.perf_counter() - t0))
        row["dense"] = dense_rate(pairs, sizes, device, case.tokens, gen, left)
    except (RuntimeError, torch.OutOfMemoryError) as err:  # no flash kernel for these operands, or no memory
        row["dense"] = {"error": _one_line(err)}
    for b in row["backends"]:
        if "fwd_tflops" in b and "fwd_tflops" in row["dense"]:
            b["fwd_vs_dense"] = b["fwd_tflops"] / row["dense"]["fwd_tflops"]
            b["bwd_vs_dense"] = b["bwd_tflops"] / row["dense"]["bwd_tflops"]
    return row


def _backend_row(backend, plan, case, q, bufs, dout, scale, sizes, device, hw, budget_s, fwd_flops, bwd_flops,
                 reference) -> dict:
    placed = device_layout(plan, case.rank, backend == "varlen", device)
    phases = placed.phases
    if backend == "math" and math_bytes(phases, sizes.heads) > MATH_LIMIT_BYTES:
        need = math_bytes(phases, sizes.heads)
        return {"backend": backend, "status": "skipped",
                "why": f"its largest batch needs ~{need / 1e9:.0f} GB of score matrices (limit "
                       f"{MATH_LIMIT_BYTES / 1e9:.0f} GB)"}
    try:
        t_fwd = _timed(lambda: forward(phases, q, bufs, scale, backend), device, sizes, budget_s / 2)
        out, lse = forward(phases, q, bufs, scale, backend)
        out_q = out.to(q.dtype)
        t_bwd = _timed(lambda: backward(phases, q, bufs, dout, out_q, lse, scale, backend), device, sizes,
                       budget_s / 2)
    except (RuntimeError, ValueError, torch.OutOfMemoryError) as err:
        return {"backend": backend, "status": "error", "why": _one_line(err)}
    got = {"backend": backend, "status": "ran", "fwd_ms": 1e3 * t_fwd, "bwd_ms": 1e3 * t_bwd,
           "fwd_tflops": fwd_flops / t_fwd / 1e12, "bwd_tflops": bwd_flops / t_bwd / 1e12,
           "kernel_calls": sum(len(p) for p in phases), "out": out}
    if reference is not None:
        got["max_abs_diff_vs_math"] = float((out - reference).abs().max())
    return got


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


def run(device: str, tiny: bool, budget_s: float, partial=None) -> dict:
    dev = torch.device(device)
    sizes = TINY if tiny else FULL
    preset = costs.gpu_preset(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else "cpu"
    hw = costs.preset(preset)
    setup = {"heads": sizes.heads, "kv_heads": sizes.kv_heads, "head_dim": sizes.head_dim,
             "dtype": str(sizes.dtype).removeprefix("torch."), "strategy": "flashcp", "preset": preset}
    rows, t0 = [], time.perf_counter()
    for i, case in enumerate(sizes.cases):
        left = budget_s - (time.perf_counter() - t0)
        if left < 0.1 * budget_s:
            rows.append({"case": case.label, "skipped": "out of the part's time"})
            continue
        print(f"attention: {case.label} ...", flush=True)
        rows.append(run_case(case, sizes, dev, hw, left / (len(sizes.cases) - i)))
        print(f"attention: {case.label}: {_summary(rows[-1])}", flush=True)
        if partial is not None:
            partial({"rows": rows, "setup": setup})
    ran = [b for r in rows for b in r.get("backends", ()) if b.get("status") == "ran"]
    return {"status": "passed" if ran else "failed", "rows": rows, "setup": setup}


def _summary(row: dict) -> str:
    parts = [f"{b['backend']} {b['fwd_tflops']:.3g}/{b['bwd_tflops']:.3g}" if b.get("status") == "ran"
             else f"{b['backend']} {b.get('status')}" for b in row.get("backends", ())]
    dense = row.get("dense", {})
    if "fwd_tflops" in dense:
        parts.append(f"dense {dense['fwd_tflops']:.3g}/{dense['bwd_tflops']:.3g}")
    return "TFLOP/s fwd/bwd: " + ", ".join(parts)
