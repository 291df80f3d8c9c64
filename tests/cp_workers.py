"""Per-rank bodies of the context-parallel attention tests, run by dist_harness.run_ranks.

Every rank builds the whole packed sequence's q, k, v and output gradient from one seed; the
reference is float64 softmax attention on the whole sequence under the causal document mask
(an explicit T x T mask, fine at these sizes), differentiated by autograd.  Each rank runs
``flashpar.cp.attention`` on its shard and compares its rows of the output and of dq, dk, dv.
"""

from __future__ import annotations

import math
import random

import torch

from flashpar.corpus import document_lengths
from flashpar.cp import STRATEGIES, CommCounter, CostModel, attention, gather, plan, shard
from flashpar.cp.lengths import pack

# fp32: every output row is a softmax-weighted sum over <= 200 keys and every gradient entry a
# sum over <= 200 rows; the CPU flash kernel and the merge differ from the float64 reference by
# rounding only (~1e-6 relative); 1e-5 leaves margin, while one misplaced key block is O(1e-1).
FP32_TOL = 1e-5
# bf16 inputs and outputs (unit roundoff 3.9e-3); the kernel accumulates in fp32, merges and
# gradient returns round to bf16 a few times: a few units of roundoff relative to the largest entry.
BF16_TOL = 3e-2
H, HKV, D = 4, 2, 8


def length_lists(n: int) -> dict[str, list[int]]:
    rng = random.Random(1000 + n)
    corpus = [x for x in document_lengths(60)]
    return {
        "random": [rng.choice([1, 2, 3, 5, 9, 17, 33, 60]) for _ in range(12)],
        "ones": [1] * 7 + [2 * n - 1, 1],  # documents of length 1 and shorter than 2N
        "single": [157],  # one document spanning everything
        "mixed": [90, 3, 5, 1, 40, 2, 7, 12],  # long documents that flashcp shards over sub-groups
        "corpus": pack([max(1, x // 97) for x in corpus], 180)[0],  # real lengths (scaled) from the corpus
    }


def reference(doc_lens, q, k, v, dout, scale, window=None):
    """float64 output and gradients on the whole sequence (explicit causal document mask; ``window``: the query's
    ``window`` latest keys of its document only, its own included)."""
    doc = torch.repeat_interleave(torch.arange(len(doc_lens)), torch.tensor(doc_lens))
    t = torch.arange(len(doc))
    ahead = t[:, None] - t[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (ahead >= 0) & (ahead < (window or len(doc)))
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("thd,shd->hts", q, k.repeat_interleave(g, 1)) * scale
    p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1)
    out = torch.einsum("hts,shd->thd", p, v.repeat_interleave(g, 1))
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max error over the reference's largest entry.  Inputs are N(0, 1), so outputs and gradients
    are O(1); where the reference is near zero (dq and dk of one-token documents are exactly 0)
    the error is measured against 1 instead."""
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1.0))


def run_case(rank, n, doc_lens, strategy, dtype=torch.float32, heads=(H, HKV), backend=None, seed=0, fused=False):
    """This rank's relative errors and the bytes it sent; None where all is well.  ``fused``: k and v
    are strided views of one ``[T, 2 H_kv, D]`` tensor (as split out of a fused projection)."""
    h, hkv = heads
    cost = CostModel(kv_heads=hkv, head_dim=D, dtype_bytes=torch.finfo(dtype).bits // 8)
    p = plan(doc_lens, n, strategy=strategy, cost=cost)
    gen = torch.Generator().manual_seed(seed)
    total = sum(doc_lens)
    q, dout = (torch.randn(total, h, D, generator=gen) for _ in range(2))
    k, v = (torch.randn(total, hkv, D, generator=gen) for _ in range(2))
    scale = 0.3
    ref = reference(doc_lens, q, k, v, dout, scale)
    mine = [shard(x, p, rank).to(dtype).requires_grad_() for x in (q, k, v)]
    counter = CommCounter()
    if fused:
        kv = torch.cat(mine[1:], dim=1).detach().requires_grad_()
        out = attention(mine[0], kv[:, :hkv], kv[:, hkv:], p, softmax_scale=scale, counter=counter, backend=backend)
        out.backward(shard(dout, p, rank).to(dtype))
        got = [out.detach(), mine[0].grad, kv.grad[:, :hkv], kv.grad[:, hkv:]]
    else:
        out = attention(*mine, p, softmax_scale=scale, counter=counter, backend=backend)
        out.backward(shard(dout, p, rank).to(dtype))
        got = [out.detach(), *(x.grad for x in mine)]
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    errors = {name: _rel(g, shard(r, p, rank)) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True)}
    bad = {k_: e for k_, e in errors.items() if not e <= tol}
    whole = gather(out.detach(), p)
    if _rel(whole, ref[0]) > tol:
        bad["gather"] = _rel(whole, ref[0])
    stats = p.stats()
    return {"bad": bad or None, "fwd_sent": counter.fwd_sent, "bwd_sent": counter.bwd_sent,
            "fwd_recv": counter.fwd_recv, "bwd_recv": counter.bwd_recv, "plan_send": stats["kv_send_bytes"][rank],
            "plan_recv": stats["kv_recv_bytes"][rank], "tokens": stats["tokens"]}


def all_cases(rank, n):
    out = {}
    for name, lens in length_lists(n).items():
        for strategy in STRATEGIES:
            out[(name, strategy)] = run_case(rank, n, lens, strategy)
    lens = length_lists(n)["random"]
    for strategy in STRATEGIES:
        out[("random", strategy, "bf16")] = run_case(rank, n, lens, strategy, dtype=torch.bfloat16)
    for strategy in ("flashcp", "headtail", "per_doc"):
        out[("random", strategy, "mha")] = run_case(rank, n, lens, strategy, heads=(2, 2))
        out[("random", strategy, "math")] = run_case(rank, n, lens, strategy, backend="math")
        out[("random", strategy, "varlen")] = run_case(rank, n, lens, strategy, backend="varlen")
        out[("random", strategy, "fused")] = run_case(rank, n, lens, strategy, fused=True)
    return out


def bad_inputs(rank, n):
    """Each bad call must raise on every rank (returns the messages); a hang fails the harness timeout."""
    lens = [20, 7, 1, 13]
    p = plan(lens, n)
    other = plan(lens, n + 1)
    total = sum(lens)
    q = torch.randn(total, H, D)
    kv = torch.randn(total, HKV, D)
    mine = shard(q, p, rank), shard(kv, p, rank)
    cases = {
        "tokens": lambda: attention(mine[0][1:] if rank == n - 1 else mine[0],
                                    *(x[1:] if rank == n - 1 else x for x in (mine[1], mine[1])), p),
        "heads": lambda: attention(shard(torch.randn(total, 3, D), p, rank), mine[1], mine[1], p),
        "cp_size": lambda: attention(mine[0], mine[1], mine[1], other),
        "plan": lambda: attention(*(shard(x, pl, rank) for x in (q, kv, kv)), pl)
        if (pl := plan(lens, n, strategy="per_doc" if rank == 0 else "headtail")) else None,
        "layout": lambda: attention(mine[0].transpose(0, 1), mine[1], mine[1], p),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except (ValueError, RuntimeError) as err:
            out[name] = str(err)
    return out


def subgroup_case(rank, n):
    """Two CP groups of two ranks inside a world of four (as a (dp, cp) mesh makes them), each
    with its own documents: the transfers must address global ranks of its own group."""
    import torch.distributed as dist

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = rank // 2
    lens = [[30, 2, 17, 1, 9], [5, 44, 3]][mine]
    out = {}
    for strategy in ("flashcp", "per_doc_aware", "headtail", "per_doc"):
        p = plan(lens, 2, strategy=strategy)
        gen = torch.Generator().manual_seed(mine)
        total = sum(lens)
        q, dout = (torch.randn(total, H, D, generator=gen) for _ in range(2))
        k, v = (torch.randn(total, HKV, D, generator=gen) for _ in range(2))
        ref = reference(lens, q, k, v, dout, D**-0.5)
        local = rank % 2
        xs = [shard(x, p, local).requires_grad_() for x in (q, k, v)]
        y = attention(*xs, p, group=groups[mine])
        y.backward(shard(dout, p, local))
        errs = [_rel(g, shard(r, p, local)) for g, r in zip([y.detach(), *(x.grad for x in xs)], ref, strict=True)]
        out[strategy] = None if max(errs) <= FP32_TOL else errs
    return out
