"""Part ``gemm``: the GEMM efficiency lost by splitting a tensor-parallel linear into N row pieces.

FlashOverlap computes a TP-SP linear piece by piece, each piece's rows written into their slice of the
output while the next piece's transfer is in flight (``flashpar.overlap.ops``:
``torch.mm(x_piece, w_t, out=out_piece)``).  Splitting costs GEMM efficiency; this part measures how
much, at the per-rank shapes of an 8B Llama (hidden 4096, FFN 14336, 32 heads, 8 kv heads of 128) on
TP 2, 4, 8 with ``tokens`` rows:

    linear     x [m, k]               w [n, k]
    qkv        [tokens, 4096]         [(32 + 2 8) 128 / tp, 4096]    column parallel, after the all-gather
    attn_out   [tokens, 4096 / tp]    [4096, 4096 / tp]              row parallel, before the reduce-scatter
    mlp_up     [tokens, 4096]         [2 14336 / tp, 4096]           gate and up fused
    mlp_down   [tokens, 14336 / tp]   [4096, 14336 / tp]

    efficiency(N) = time of one GEMM / time of its N pieces (torch.tensor_split of the rows)

and beside it the cost model's prediction for the device's preset (``Hardware.gemm_time``:
``gemm_overhead_s`` per call and the small-M curve ``half_rows``), so the preset can be calibrated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flashpar import cost as costs
from flashpar.gpu_check.timing import median_seconds


@dataclass(frozen=True)
class Sizes:
    tokens: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    tps: tuple[int, ...]
    pieces: tuple[int, ...]
    dtype: torch.dtype
    reps: int


FULL = Sizes(8192, 4096, 14336, 32, 8, 128, (2, 4, 8), tuple(range(2, 9)), torch.bfloat16, reps=10)
TINY = Sizes(96, 32, 64, 4, 2, 8, (2, 4), (2, 3), torch.float32, reps=2)


def linears(s: Sizes, tp: int) -> list[tuple[str, int, int, int]]:
    """``(name, m, k, n)`` of the four per-rank GEMMs of a layer at tensor-parallel size ``tp``."""
    h, qkv = s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim
    return [("qkv", s.tokens, h, qkv // tp), ("attn_out", s.tokens, s.heads * s.head_dim // tp, h),
            ("mlp_up", s.tokens, h, 2 * s.ffn // tp), ("mlp_down", s.tokens, s.ffn // tp, h)]


def split_rows(m: int, n: int) -> list[int]:
    """Row counts of ``torch.tensor_split`` into ``n`` pieces."""
    return [len(r) for r in torch.arange(m).tensor_split(n)]


def predicted_efficiency(hw: costs.Hardware, m: int, k: int, n: int, pieces: int) -> float:
    return hw.gemm_time(m, k, n) / sum(hw.gemm_time(r, k, n) for r in split_rows(m, pieces))


def measure(name: str, m: int, k: int, n: int, s: Sizes, device: torch.device, hw: costs.Hardware, gen,
            budget_s: float) -> list[dict]:
    x = torch.randn(m, k, device=device, dtype=s.dtype, generator=gen)
    w = torch.randn(n, k, device=device, dtype=s.dtype, generator=gen)
    out = torch.empty(m, n, device=device, dtype=s.dtype)
    w_t = w.t()
    share = budget_s / (1 + len(s.pieces))
    one = median_seconds(lambda: torch.mm(x, w_t, out=out), device, warmup=2, reps=s.reps, budget_s=share)
    rows = []
    for pieces in s.pieces:
        views = list(zip(x.tensor_split(pieces), out.tensor_split(pieces), strict=True))

        def split(views=views):
            for xp, op in views:
                torch.mm(xp, w_t, out=op)

        t = median_seconds(split, device, warmup=2, reps=s.reps, budget_s=share)
        rows.append({"linear": name, "m": m, "k": k, "n": n, "pieces": pieces, "one_ms": 1e3 * one,
                     "split_ms": 1e3 * t, "efficiency": one / t, "one_tflops": 2 * m * k * n / one / 1e12,
                     "predicted_efficiency": predicted_efficiency(hw, m, k, n, pieces)})
    return rows


def run(device: str, tiny: bool, budget_s: float, partial=None) -> dict:
    dev = torch.device(device)
    s = TINY if tiny else FULL
    preset = costs.gpu_preset(torch.cuda.get_device_name(dev)) if dev.type == "cuda" else "cpu"
    hw = costs.preset(preset)
    gen = torch.Generator(device=dev).manual_seed(0)
    setup = {"tokens": s.tokens, "hidden": s.hidden, "ffn": s.ffn, "heads": s.heads, "kv_heads": s.kv_heads,
             "head_dim": s.head_dim, "dtype": str(s.dtype).removeprefix("torch."), "preset": preset}
    rows, t0 = [], time.perf_counter()
    shapes = [(tp, *lin) for tp in s.tps for lin in linears(s, tp)]
    for i, (tp, name, m, k, n) in enumerate(shapes):
        left = budget_s - (time.perf_counter() - t0)
        if left < 0.05 * budget_s:
            rows.append({"tp": tp, "linear": name, "skipped": "out of the part's time"})
            continue
        for r in measure(name, m, k, n, s, dev, hw, gen, left / (len(shapes) - i)):
            rows.append({"tp": tp, **r})
        done = [r for r in rows if r.get("tp") == tp and r.get("linear") == name and "efficiency" in r]
        print(f"gemm: tp {tp} {name} [{m}, {k}] x [{k}, {n}]: one {done[0]['one_tflops']:.3g} TFLOP/s; efficiency "
              + " ".join(f"N={r['pieces']} {r['efficiency']:.2f}" for r in done), flush=True)
        if partial is not None:
            partial({"rows": rows, "setup": setup})
    measured = [r for r in rows if "efficiency" in r]
    by_pieces = {p: [r["efficiency"] for r in measured if r["pieces"] == p] for p in s.pieces}
    summary = [{"pieces": p, "mean_efficiency": sum(v) / len(v), "worst_efficiency": min(v),
                "mean_predicted": sum(r["predicted_efficiency"] for r in measured if r["pieces"] == p) / len(v)}
               for p, v in by_pieces.items() if v]
    return {"status": "passed" if measured else "failed", "rows": rows, "by_pieces": summary, "setup": setup}
