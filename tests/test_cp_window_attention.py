"""Sliding-window context-parallel attention against float64 whole-sequence references on gloo at N = 1..4.

Every rank builds the whole packed sequence's q, k, v and output gradient from one seed; the reference is float64
softmax attention on the whole sequence under the windowed causal document mask (query ``p`` of a document sees
its keys ``[p - W + 1, p]``: transformers' ``sliding_window``), differentiated by autograd.  Each rank runs
``flashpar.cp.attention(..., window=W)`` on its shard and compares its rows of the output and of dq, dk, dv, and
the bytes it sent and received with the window's receive sets (``flashpar.cp.window``).
"""

from __future__ import annotations

import pytest
import torch

from cp_workers import FP32_TOL, HKV, D, H, _rel, reference
from dist_harness import SpawnCache
from flashpar.cp import STRATEGIES, CommCounter, CostModel, attention, plan, shard
from flashpar.cp import window as band

# float64 throughout: the kernels and the log-sum-exp merge differ from the reference by rounding of a few dozen
# float64 operations per entry (~1e-15 relative to O(1) entries); 1e-10 leaves five orders of margin, while one
# key inside or outside the band moves an entry by O(1e-1).
FP64_TOL = 1e-10
LENGTHS = {
    "mixed": [90, 3, 5, 1, 40, 2, 7, 12],  # documents shorter and longer than the windows, cut over ranks
    "single": [157],  # one document over every rank: windows cross every rank boundary
    "short": [1, 1, 2, 9, 1, 3, 30, 1],  # mostly shorter than every window but W = 1
}
WINDOWS = (1, 4, 23, 160)  # 160 >= every document: full causal attention


def run_case(rank, n, doc_lens, strategy, window, dtype=torch.float64, backend=None, p=None):
    """This rank's relative errors over FP64_TOL (FP32_TOL for float32), its bytes and the window's plan bytes."""
    p = p or plan(doc_lens, n, strategy=strategy, cost=CostModel(kv_heads=HKV, head_dim=D))
    gen = torch.Generator().manual_seed(window or 0)
    total = sum(doc_lens)
    q, dout = (torch.randn(total, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(total, HKV, D, generator=gen, dtype=torch.float64) for _ in range(2))
    ref = reference(doc_lens, q, k, v, dout, 0.3, window)
    mine = [shard(x, p, rank).to(dtype).requires_grad_() for x in (q, k, v)]
    counter = CommCounter()
    out = attention(*mine, p, softmax_scale=0.3, counter=counter, backend=backend, window=window)
    out.backward(shard(dout, p, rank).to(dtype))
    got = [out.detach(), *(x.grad for x in mine)]
    tol = FP64_TOL if dtype == torch.float64 else FP32_TOL
    errors = {name: _rel(g, shard(r, p, rank)) for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref, strict=True)}
    per_token = 2 * HKV * D * torch.finfo(dtype).bits // 8
    recv = sum(b - a for _, a, b in band.window_recv(p, rank, window)) if window else None
    return {"bad": {k_: e for k_, e in errors.items() if not e <= tol} or None, "fwd_sent": counter.fwd_sent,
            "fwd_recv": counter.fwd_recv, "bwd_sent": counter.bwd_sent, "bwd_recv": counter.bwd_recv,
            "plan_send": band.send_tokens(p, window)[rank] * per_token if window else None,
            "plan_recv": recv * per_token if window else None}


def window_cases(rank, n):
    out = {}
    for name, lens in LENGTHS.items():
        for strategy in STRATEGIES:
            for w in WINDOWS:
                out[(name, strategy, w)] = run_case(rank, n, lens, strategy, w)
    for strategy in ("flashcp", "headtail"):
        out[("mixed", strategy, 23, "fp32")] = run_case(rank, n, LENGTHS["mixed"], strategy, 23, torch.float32)
        for backend in ("math", "varlen"):
            out[("mixed", strategy, 23, backend)] = run_case(rank, n, LENGTHS["mixed"], strategy, 23, backend=backend)
    return out


def shared_plan(rank, n):
    """A windowed and a full layer on one plan, alternating as in a model: each exact, each its own exchange."""
    lens = LENGTHS["mixed"]
    p = plan(lens, n, strategy="flashcp")
    return [run_case(rank, n, lens, "flashcp", w, p=p) for w in (23, None, 4, 23, None)]


def bad_windows(rank, n):
    """Each bad window must raise on every rank (returns the messages); a hang fails the harness timeout."""
    lens = [20, 7, 1, 13]
    p = plan(lens, n)
    x = torch.randn(sum(lens), H, D)
    q, kv = shard(x, p, rank), shard(x[:, :HKV], p, rank)
    out = {}
    cases = {"zero": 0, "float": 2.5, "bool": True, "str": "8", "mismatch": 3 if rank == 0 else 4}
    for name, w in cases.items():
        if name == "mismatch" and n == 1:
            continue
        try:
            attention(q, kv, kv, p, window=w)
            out[name] = None
        except (ValueError, RuntimeError) as err:
            out[name] = str(err)
    return out


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(lambda n: [("cases", window_cases), ("shared", shared_plan), ("bad", bad_windows)])


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_windowed_output_and_gradients_match_float64_reference(spawned, n):
    per_rank = spawned(n)["cases"]
    assert len(per_rank[0]) == len(LENGTHS) * len(STRATEGIES) * len(WINDOWS) + 6
    failures = {(r, case): out["bad"] for r, rank_out in enumerate(per_rank) for case, out in rank_out.items()
                if out["bad"] is not None}
    assert not failures, failures


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_windowed_bytes_are_the_windows_receive_sets(spawned, n):
    """Forward, every rank sends and receives exactly the window's sets (point-to-point whatever the strategy);
    backward, it returns one gradient row per K/V row it received and gets one per row it sent."""
    per_rank = spawned(n)["cases"]
    for case in per_rank[0]:
        rows = [rank_out[case] for rank_out in per_rank]
        assert [x["fwd_sent"] for x in rows] == [x["plan_send"] for x in rows], case
        assert [x["fwd_recv"] for x in rows] == [x["plan_recv"] for x in rows], case
        assert [x["bwd_sent"] for x in rows] == [x["fwd_recv"] for x in rows], case
        assert [x["bwd_recv"] for x in rows] == [x["fwd_sent"] for x in rows], case


@pytest.mark.parametrize("n", [2, 4])
def test_windowed_and_full_layers_share_a_plan(spawned, n):
    per_rank = spawned(n)["shared"]
    assert all(call["bad"] is None for rank_out in per_rank for call in rank_out), per_rank
    if n > 1:  # the window's exchange is smaller than the plan's own on the same plan
        sent = lambda i: sum(rank_out[i]["fwd_sent"] for rank_out in per_rank)  # noqa: E731
        assert sent(0) == sent(3) and sent(2) <= sent(0) <= sent(1)


@pytest.mark.parametrize("n", [1, 3])
def test_bad_window_raises_one_line_on_every_rank(spawned, n):
    per_rank = spawned(n)["bad"]
    for r, out in enumerate(per_rank):
        for name, msg in out.items():
            expected = "disagree on window" if name == "mismatch" else "window must be a positive int or None"
            assert msg is not None and expected in msg and "\n" not in msg, (name, r, msg)
