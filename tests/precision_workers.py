"""Per-rank bodies of the mixed-precision and activation-checkpointing tests (run by dist_harness.run_ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from flashpar import cp
from flashpar.models.parallel import MESH_DIMS
from flashpar.train.check import one_step
from train_workers import MODELS, sequences


def bf16_steps(rank, world, cases):
    """``one_step``'s relative errors (loss, gradient norm, every gradient) of the bf16 mesh model against the fp32
    single-process model, for each ``(shape, dp_mode, model, checkpoint_activations)``: the step of
    ``flashpar train --check --dtype bf16`` (two micro-batches per dp rank, gradients clipped to half their
    norm)."""
    from flashpar.train.check import CHECK_CLIP_RATIO

    out = []
    for shape, dp_mode, model, ckpt in cases:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
        seqs = sequences(2 * shape[0], vocab=MODELS[model].vocab_size)
        out.append(one_step(MODELS[model], mesh, seqs, strategy="flashcp", mode="flash",
                            dp_mode=dp_mode, dtype="bf16", checkpoint_activations=ckpt, micro_batches=2,
                            clip_ratio=CHECK_CLIP_RATIO))
    return out


def _build(shape, dtype="fp32", ckpt=False, dp_mode="zero3", model="base"):
    from flashpar.train.config import TrainConfig
    from flashpar.train.step import build

    dp, cpn, ulysses, tp = shape
    config = TrainConfig(nproc=dp * cpn * ulysses * tp, dp=dp, cp=cpn, ulysses=ulysses, tp=tp, dp_mode=dp_mode,
                         model=MODELS[model], timeout=60.0, dtype=dtype, checkpoint_activations=ckpt)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=MESH_DIMS)
    _, net, opt = build(config, mesh, torch.device("cpu"))
    return mesh, net, opt


def _batch(mesh, strategy="flashcp"):
    """This rank's tokens, targets and plan of the dp rank's sequence, and the global target count."""
    batch = sequences(mesh["dp"].size())
    count = sum(int((lab != -100).sum()) for _, lab, _ in batch)
    tokens, labels, doc_lens = batch[mesh["dp"].get_local_rank()]
    plan, c = cp.plan(doc_lens, mesh["cp"].size(), strategy=strategy), mesh["cp"].get_local_rank()
    return cp.shard(tokens, plan, c), cp.shard(labels, plan, c), plan, count


def dtypes_after_step(rank, world, shape):
    """One bf16 step through ``build`` / ``forward_backward`` / AdamW: the dtypes of the gradients (after their
    sums), of the parameters and of AdamW's state, and the loss dtype; sets of dtype names."""
    from flashpar.train.step import forward_backward

    mesh, net, opt = _build(shape, "bf16")
    tokens, labels, plan, count = _batch(mesh)
    loss = forward_backward(net, tokens, labels, plan, count)
    grads = {str(p.grad.dtype) for p in net.parameters()}
    opt.step()
    state = {str(t.dtype) for s in opt.state.values() for k, t in s.items() if k != "step"}
    return {"grads": grads, "params": {str(p.dtype) for p in net.parameters()}, "state": state,
            "loss": str(loss.dtype), "compute": str(net.compute_dtype)}


def checkpointing_equal(rank, world, cases):
    """For each ``(shape, dp_mode, model)``: one fp32 ``forward_backward`` with and without activation
    checkpointing on the same weights and batch: ``(loss difference, max relative gradient difference, K/V
    counter without, with, the recomputation's counter)``.  The plan is per_doc (every document split over the
    cp ranks: K/V traffic on every rank; flashcp keeps these short documents whole, with none)."""
    from flashpar.train.step import forward_backward

    out = []
    for shape, dp_mode, model in cases:
        runs = []
        for ckpt in (False, True):
            mesh, net, _ = _build(shape, ckpt=ckpt, dp_mode=dp_mode, model=model)
            tokens, labels, plan, count = _batch(mesh, "per_doc")
            loss = forward_backward(net, tokens, labels, plan, count)
            dist.all_reduce(loss)
            counters = [vars(c).copy() for c in (net.kv_counter, net.kv_recompute)]
            runs.append((float(loss), net.full_grads(), counters))
        (l0, g0, (kv0, _)), (l1, g1, (kv1, rec1)) = runs
        diff = max(float((g1[n] - g0[n]).abs().max() / g0[n].abs().max().clamp_min(1e-30)) for n in g0)
        out.append((abs(l1 - l0), diff, kv0, kv1, rec1))
    return out


def zero_transport(rank, world, modes):
    """The ZeRO-3 ops (``_ZeroLinear``) on a (dp 2, tp 2) mesh with uneven weight rows, in every ``mode``: bf16
    activations with fp32 master rows against the same ops all in fp32.  Per (kind, mode): the dp bytes
    handed to the transport (``ZeroCounter``: forward, backward) of both runs, the gradient's dtype, and the
    mixed run's relative errors against float64 (output, input gradient, weight gradient)."""
    from flashpar.overlap.sharded import ZeroCounter, zero_all_gather_matmul, zero_matmul_reduce_scatter
    from flashpar.rows import row_sizes, shard_rows

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_group(), mesh["tp"].get_group()
    d, t = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    n_in, rows, seq = 24, 13, row_sizes(10, 2)  # 13 weight rows over dp 2: 7 + 6 (uneven)
    gen = torch.Generator().manual_seed(5)
    w_full = torch.randn(rows, n_in, dtype=torch.float64, generator=gen)
    out = {}
    for kind, op in (("column", zero_all_gather_matmul), ("row", zero_matmul_reduce_scatter)):
        x_full = torch.randn(10, n_in, dtype=torch.float64, generator=gen)  # the tp group's rows (dp rank's batch)
        gy_full = torch.randn(10, rows, dtype=torch.float64, generator=gen)
        lo, hi = shard_rows(rows, 2, d)
        s0 = sum(seq[:t])
        mine = slice(s0, s0 + seq[t])
        for mode in modes:
            runs = {}
            for name, act in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                counter = ZeroCounter()
                w = w_full[lo:hi].float().requires_grad_()
                x = (x_full[mine] if kind == "column" else x_full).to(act).requires_grad_()
                y = op(x, w, group=tp, dp_group=dp, total_rows=rows, mode=mode, split_sizes=seq, counter=counter)
                y.backward((gy_full if kind == "column" else gy_full[mine]).to(act))
                runs[name] = (counter.bytes[("fwd", "dp")][0], counter.bytes[("bwd", "dp")][0], y, x.grad, w.grad)
            # float64 reference: the dp ranks hold different batches (seeded alike here: the same), the weight
            # gradient summed over the 2 dp ranks
            y_ref = x_full @ w_full.t()
            gx_ref = gy_full @ w_full
            gw_ref = 2 * (gy_full.t() @ x_full)[lo:hi]
            _, _, y, gx, gw = runs["bf16"]
            # both tp ranks hold the same W_t, so the tp reduce-scatter (column: of grad_x, row: of y) sums 2 copies
            y_want, gx_want = (y_ref, 2 * gx_ref[mine]) if kind == "column" else (2 * y_ref[mine], gx_ref)
            rel = lambda a, b: float((a.detach().double() - b).abs().max() / b.abs().max())  # noqa: E731
            out[(kind, mode)] = {"bytes": {k: runs[k][:2] for k in runs}, "grad_dtype": str(gw.dtype),
                                 "y_dtype": str(y.dtype),
                                 "errors": (rel(y, y_want), rel(gx, gx_want), rel(gw, gw_ref))}
    return out
