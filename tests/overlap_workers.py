"""Per-rank bodies of the error, module and device-mesh tests (run by dist_harness.run_ranks)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from flashpar.overlap import ColumnParallelLinear, RowParallelLinear, all_gather_matmul, matmul_reduce_scatter

FP32_TOL = 1e-5  # see overlap_cases.FP32_TOL


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the outcome is what the test inspects
        return f"{type(err).__name__}: {err}"
    return "ok"


def error_cases(rank: int, n: int) -> dict[str, str]:
    x = torch.randn(4, 8)
    w = torch.randn(6, 8)
    out = {
        "unknown_mode": _outcome(lambda: all_gather_matmul(x, w, mode="fast")),
        "feature_mismatch": _outcome(lambda: all_gather_matmul(x, torch.randn(6, 7))),
        "bad_chunks": _outcome(lambda: matmul_reduce_scatter(torch.randn(4 * n, 8), w.t().contiguous(), chunks=0)),
        "split_not_add_up": _outcome(
            lambda: matmul_reduce_scatter(torch.randn(4 * n, 8), torch.randn(5, 8), split_sizes=[4] * (n - 1) + [3])),
        "not_divisible": _outcome(lambda: matmul_reduce_scatter(torch.randn(4 * n + 1, 8), torch.randn(5, 8))),
        "devices": _outcome(lambda: all_gather_matmul(x, torch.randn(6, 8, device="meta"))),
        "dtypes": _outcome(lambda: all_gather_matmul(x, w.double())),
        "bad_peers_per_piece": _outcome(lambda: all_gather_matmul(x, w, peers_per_piece=0)),
        "peers_per_piece_ring": _outcome(lambda: all_gather_matmul(x, w, mode="ring", peers_per_piece=2)),
        "peers_per_piece_chunks": _outcome(
            lambda: matmul_reduce_scatter(torch.randn(4 * n, 8), w.t().contiguous(), chunks=2, peers_per_piece=2)),
        "peers_per_piece_auto": _outcome(lambda: all_gather_matmul(x, w, mode="auto", peers_per_piece=2)),
    }
    if n > 1:
        bad_w = torch.randn(6, 7) if rank == 1 else w  # rank 1 alone has a weight that does not fit x
        out["one_rank_bad"] = _outcome(lambda: all_gather_matmul(x, bad_w))
        feat = torch.randn(4, 7) if rank == 1 else x  # consistent on each rank, different across ranks
        out["features_differ"] = _outcome(lambda: all_gather_matmul(feat, torch.randn(6, feat.shape[1])))
        mid = torch.randn(4, 3 if rank == 0 else 2, 8)
        out["mid_shape_differs"] = _outcome(lambda: all_gather_matmul(mid, w))
        xd = x.double() if rank == n - 1 else x
        wd = w.double() if rank == n - 1 else w
        out["dtype_differs"] = _outcome(lambda: all_gather_matmul(xd, wd))
        rows = 5 if rank == 0 else 4
        out["split_sizes_wrong"] = _outcome(lambda: all_gather_matmul(torch.randn(rows, 8), w, split_sizes=[4] * n))
        split = [4] * n if rank else [5] + [4] * (n - 2) + [3]  # each adds up to 4n; they disagree
        out["rs_split_differs"] = _outcome(
            lambda: matmul_reduce_scatter(torch.randn(4 * n, 8), torch.randn(5, 8), split_sizes=split))
        out["rs_seq_differs"] = _outcome(
            lambda: matmul_reduce_scatter(torch.randn(4 * n + (n if rank == 0 else 0), 8), torch.randn(5, 8)))
    # the group is still healthy after all of the above
    y = all_gather_matmul(torch.full((2, 8), float(rank)), torch.eye(8))
    expect = torch.arange(n, dtype=torch.float32).repeat_interleave(2)[:, None].expand(2 * n, 8)
    out["healthy_after"] = "ok" if torch.equal(y, expect) else f"wrong result {y[:, 0].tolist()}"
    return out


def missing_peer(rank: int, n: int, check: bool) -> str:
    """Rank 1 never calls the op: rank 0 must raise within its timeout, naming the op, itself and the peer."""
    if rank == 1:
        time.sleep(6.0)
        return "skipped"
    t0 = time.monotonic()
    msg = _outcome(lambda: all_gather_matmul(torch.randn(4, 8), torch.randn(6, 8), check=check, timeout_s=2.0))
    return f"{msg} [after {time.monotonic() - t0:.1f}s]"


def uneven_features(rank: int, n: int) -> str:
    return _outcome(lambda: ColumnParallelLinear.from_linear(nn.Linear(4, 6)))


def mlp_modules(rank: int, n: int, modes: list[str]) -> dict[str, str | None]:
    return {mode: mlp_module(rank, n, mode) for mode in modes}


def mlp_module(rank: int, n: int, mode: str) -> str | None:
    """Column- then row-parallel MLP converted from full nn.Linear layers vs the full float64 model."""
    torch.manual_seed(0)  # same full model and data on every rank
    fc1, fc2 = nn.Linear(8, 24), nn.Linear(24, 8)
    s_local = 3
    x_full = torch.randn(s_local * n, 2, 8)
    gy_full = torch.randn(s_local * n, 2, 8)
    col = ColumnParallelLinear.from_linear(fc1, mode=mode, chunks=2 if mode == "flash" else None)
    row = RowParallelLinear.from_linear(fc2, mode=mode)
    rows = slice(rank * s_local, (rank + 1) * s_local)
    x = x_full[rows].clone().requires_grad_()
    y = row(F.gelu(col(x)))
    y.backward(gy_full[rows])
    ref1, ref2 = nn.Linear(8, 24).double(), nn.Linear(24, 8).double()
    ref1.load_state_dict(fc1.state_dict())
    ref2.load_state_dict(fc2.state_dict())
    xr = x_full.double().requires_grad_()
    yr = ref2(F.gelu(ref1(xr)))
    yr.backward(gy_full.double())
    h = 24 // n
    pairs = {
        "y": (y, yr[rows]), "grad_x": (x.grad, xr.grad[rows]),
        "col.weight": (col.weight.grad, ref1.weight.grad[rank * h : (rank + 1) * h]),
        "col.bias": (col.bias.grad, ref1.bias.grad[rank * h : (rank + 1) * h]),
        "row.weight": (row.weight.grad, ref2.weight.grad[:, rank * h : (rank + 1) * h]),
        "row.bias (replicated, full gradient)": (row.bias.grad, ref2.bias.grad),
    }
    bad = []
    for name, (got, ref) in pairs.items():
        err = float((got.double() - ref).norm() / ref.norm())
        if not err <= FP32_TOL:
            bad.append(f"{name}: rel err {err:.3g}")
    return "; ".join(bad) or None


def device_mesh(rank: int, n: int) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    x = torch.full((2, 4), float(rank))
    y = all_gather_matmul(x, torch.eye(4), group=mesh)
    expect = torch.arange(n, dtype=torch.float32).repeat_interleave(2)
    out["1d_mesh"] = "ok" if torch.equal(y[:, 0], expect) else f"wrong {y[:, 0].tolist()}"
    if n == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        out["2d_mesh_rejected"] = _outcome(lambda: all_gather_matmul(x, torch.eye(4), group=mesh2))
        sub = mesh2["tp"]
        y = all_gather_matmul(x, torch.eye(4), group=sub)
        peers = [r for r in range(4) if r // 2 == rank // 2]  # tp groups: {0,1}, {2,3}
        expect = torch.tensor(peers, dtype=torch.float32).repeat_interleave(2)
        out["sub_mesh"] = "ok" if torch.equal(y[:, 0], expect) else f"wrong {y[:, 0].tolist()}"
    if n == 2:  # the lifetime does not depend on the group size
        out["group_lifetime"] = group_lifetime(rank, n)
    return out


def group_lifetime(rank: int, n: int) -> str:
    """A destroyed group takes its lane worker and its twin-group entry with it; a later group gets its own.
    The op runs two chunks per peer: the second transfer queues behind the first, which starts the worker (an
    op with one transfer posts and waits for it on the calling thread and never needs one)."""
    import gc
    import weakref

    import torch.distributed as dist

    from flashpar import dist as fdist
    from flashpar.overlap import lane

    def use(group) -> tuple[list, object]:
        y = all_gather_matmul(torch.full((2, 4), float(rank)), torch.eye(4), group=group, mode="flash", chunks=2)
        expect = torch.arange(n, dtype=torch.float32).repeat_interleave(2)
        assert torch.equal(y[:, 0], expect), y[:, 0].tolist()
        return lane.workers_of(group), fdist._UPWARD_GROUPS.get(group)

    before = len(fdist._UPWARD_GROUPS)
    group = dist.new_group(list(range(n)))
    workers, twin = use(group)
    if len(workers) != 1 or twin is None or len(fdist._UPWARD_GROUPS) != before + 1:
        return f"expected one worker and one twin, got {workers}, {twin}"
    alive = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    workers[0].thread.join(5.0)
    if alive() is not None or workers[0].thread.is_alive():
        return "the destroyed group or its lane worker is still alive"
    if len(fdist._UPWARD_GROUPS) != before:
        return f"the destroyed group's twin entry leaked ({len(fdist._UPWARD_GROUPS)} entries, was {before})"
    again = dist.new_group(list(range(n)))
    new_workers, new_twin = use(again)
    if new_twin is None or new_twin is twin or new_workers[0] is workers[0]:
        return "a new group reused the destroyed group's twin or worker"
    return "ok"
