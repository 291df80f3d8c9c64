"""The time of one training step of a configuration (``flashpar.sim.peers``) on a workload, from the runtime's
own schedules and plans and the one cost model.

Per block (forward; backward mirrored), on the cp rank whose layer takes longest::

    attn_norm, rope, residuals, SwiGLU            elementwise passes at memory bandwidth + kernel launches
    qkv    ag_matmul  (tp) | matmul_a2a (U)       flashpar.overlap.simulate.predict: the op's schedule in the
    attention                                      peer's mode, timed on the group's link
    o_proj matmul_rs  (tp) | a2a_matmul (U)
    gate_up ag_matmul, down matmul_rs  (tp; plain GEMMs on T_u rows otherwise)
    ZeRO-3 (dp > 1): the op's sharded schedule on the dp link, composed with the tp one: compute the larger of
                     the two decompositions' computes, exposures added (they ride different links)
    attention: the peer's plan (flashpar.cp.plan) on every pack, each cp rank timed by the planner's own
               rank_figures (local-first overlap: max(compute, K/V comm + remote compute)); torch: the
               K/V all-gather (ring, blocking) + the kernel (document blocks, or dense S_loc x S)
    a rank with more tokens runs its linears longer in proportion (tokens_r / T_cp)
    an ag_matmul's backward reads the x its forward gathered (the trainer's default; torch's DTensor linear),
    or gathers it again (``--regather``, and every ZeRO-3 linear): ``gathers_again``

Once per step: the vocabulary-parallel embedding (reduce-scatter over tp, exposed) and head (ag_matmul over
tp) with the loss, or, flashpar and baseline with a vocabulary smaller than T_u (``gathers_vocab``), the
weights' all-gathers (reduce-scatters in backward, fp32, exposed) and each rank's own rows against the whole
vocabulary; the gradient sums (flashpar, baseline: all-reduces posted during backward on one lane, the
exposed tail counted); torch: FSDP2's per-block all-gathers (one block ahead) and reduce-scatters; AdamW
(28 bytes moved per local parameter: read p, g, m, v, write p, m, v).  With activation checkpointing every
block's forward runs again in backward.

    step = forward + backward + exposed gradient sums + optimizer
    no_comm = the same with every transfer skipped (what bench train's no-communication step runs)
"""

from __future__ import annotations

import functools

from flashpar.cost import Hardware
from flashpar.models.vocab import gathers_weight
from flashpar.overlap.simulate import all_reduce_time
from flashpar.sim.parts import Part, total
from flashpar.sim.peers import Peer
from flashpar.sim.workload import Workload

ADAMW_BYTES_PER_PARAM = 28
KERNELS_PER_BLOCK = (16, 32)
"""Kernel launches of a block besides its GEMMs and attention (norms, rope, residual adds, SwiGLU, casts),
forward and backward; each costs the device's ``gemm_overhead_s``."""


# ----------------------------------------------------------------------------------------------
# the linears


def _op(op: str, mode: str, n: int, rows: float, n_in: int, n_out: int, elem: int, hw: Hardware,
        key: str, regather: bool = True) -> tuple[Part, Part]:
    """(forward, backward) of one linear: its schedule over ``n`` ranks (plain GEMMs when ``n == 1``);
    ``regather``: an ``ag_matmul``'s backward gathers ``x`` again (else it reads the forward's copy)."""
    rows = max(int(round(rows)), 1)
    if n == 1:
        fwd = hw.gemm_time(rows, n_in, n_out)
        return Part.of(fwd), Part.of(2 * fwd)
    return _predicted(op, mode, n, rows, n_in, n_out, elem, hw, key, regather)


@functools.lru_cache(maxsize=4096)
def _predicted(op, mode, n, rows, n_in, n_out, elem, hw, key, regather) -> tuple[Part, Part]:
    from flashpar.overlap.simulate import predict

    t = predict(op, mode, 1, n, rows, n_in, n_out, elem, hw, regather=regather)
    f, b = t[op], t[f"{op}_bwd"]
    return (Part.of(f.compute, **{key: f.total - f.compute}), Part.of(b.compute, **{key: b.total - b.compute}))


def _with_zero(inner: tuple[Part, Part], zero: tuple[Part, Part], plain: tuple[Part, Part]) -> tuple[Part, Part]:
    """An op of ``inner`` (the tp / plain schedule) whose weight ZeRO-3 gathers over dp (``zero``: the sharded
    schedule in the same mode, ``plain``: in mode none).  The compute is the inner one plus what cutting the
    GEMM into dp pieces costs (``zero - plain``: the sharded model times its GEMMs by weight rows, so only the
    difference of the two modes is the decomposition's); the exposures of both are added (different links)."""
    out = []
    for a, z, p in zip(inner, zero, plain, strict=True):
        part = Part(a.compute + max(z.compute - p.compute, 0.0))
        part.add(Part(0.0, a.exposed)).add(Part(0.0, z.exposed))
        out.append(part)
    return out[0], out[1]


def head_gathers_again(w: Workload, peer: Peer) -> bool:
    """Whether the head's all-gather + GEMM gathers its input again in backward: only with ``--regather``
    (the head is never ZeRO-split; torch's DTensor linear keeps its input)."""
    return w.regather and peer.data_parallel != "fsdp"


def gathers_vocab(w: Workload, peer: Peer) -> bool:
    """Whether the tp ranks gather the embedding and head weights instead of moving the activations: flashpar
    and baseline where the vocabulary is smaller than the rank's tokens (``flashpar.models.vocab.gathers_weight``,
    on the mean T_u); torch's vocabulary-parallel plans always move the activations."""
    s = w.sizes(peer)
    return w.gather_vocab and peer.data_parallel != "fsdp" and gathers_weight(w.cfg.vocab_size, s["t_u"], s["tp"])


def gathers_again(w: Workload, peer: Peer) -> bool:
    """Whether a block's column-parallel linear gathers its input again in backward: as the head does, and
    flashpar's and baseline's ZeRO-3 linears always (``flashpar.models.parallel``)."""
    return head_gathers_again(w, peer) or (peer.data_parallel == "zero3" and w.layout.dp > 1)


def linears(w: Workload, peer: Peer) -> tuple[Part, Part]:
    """(forward, backward) of one block's four linears at the mean rows ``T_u`` of a rank."""
    cfg, s, g = w.cfg, w.sizes(peer), w.groups(peer)
    h, d, f, tp, u = cfg.hidden, cfg.head_dim, cfg.ffn, s["tp"], s["u"]
    e, mode, rows = w.elem_bytes, peer.mode, s["t_u"]
    zero = peer.data_parallel == "zero3" and w.layout.dp > 1
    regather = gathers_again(w, peer)
    dp_n, dp_hw = g["dp"][0], g["dp"][1]
    ops = []
    if u > 1:  # Ulysses: the projections whole, fused with the all-to-alls (never ZeRO-split)
        u_hw = g["ulysses"][1]
        ops.append(_op("matmul_a2a", mode, u, s["t_cp"], h, (s["heads"] + 2 * s["kv_heads"]) * d, e, u_hw, "ulysses"))
        ops.append(_op("a2a_matmul", mode, u, s["t_cp"], s["heads"] * d, h, e, u_hw, "ulysses"))
        zero_split = [False, False]
    else:
        tp_hw = g["tp"][1]
        ops.append(_op("ag_matmul", mode, tp, rows, h, (cfg.heads + 2 * cfg.kv_heads) * d // tp, e, tp_hw, "tp",
                       regather))
        ops.append(_op("matmul_rs", mode, tp, rows, cfg.heads * d // tp, h, e, tp_hw, "tp"))
        zero_split = [True, True]
    tp_hw = g["tp"][1]
    ops.append(_op("ag_matmul", mode, tp, rows, h, 2 * f // tp, e, tp_hw, "tp", regather))
    ops.append(_op("matmul_rs", mode, tp, rows, f // tp, h, e, tp_hw, "tp"))
    zero_split += [True, True]
    shapes = [(h, (cfg.heads + 2 * cfg.kv_heads) * d // tp), (cfg.heads * d // tp, h), (h, 2 * f // tp),
              (f // tp, h)]
    fwd, bwd = Part(), Part()
    for (of, ob), split, (n_in, n_out) in zip(ops, zero_split, shapes, strict=True):
        if zero and split:
            zb_elem = (e + w.zero_rs_elem_bytes) // 2  # backward: the weight gathered again, the fp32 gradient out
            zf, zb = _op("sharded", mode, dp_n, rows, n_in, n_out, e, dp_hw, "dp")[0], \
                _op("sharded", mode, dp_n, rows, n_in, n_out, zb_elem, dp_hw, "dp")[1]
            pf, pb = _op("sharded", "none", dp_n, rows, n_in, n_out, e, dp_hw, "dp")
            of, ob = _with_zero((of, ob), (zf, zb), (pf, pb))
        fwd.add(of)
        bwd.add(ob)
    return fwd, bwd


def elementwise(w: Workload, peer: Peer, hw: Hardware) -> tuple[Part, Part]:
    """(forward, backward) of a block's elementwise work: two RMSNorms and two residual adds on the rank's
    ``T_u / tp`` rows of ``hidden`` (3 passes each), rope on its q and k (3 passes), SwiGLU's silu(g) u on
    ``T_u`` rows of ``ffn / tp`` (5 passes: read g, u, the silu, write), kernel launches; backward twice."""
    cfg, s = w.cfg, w.sizes(peer)
    rows_sp = s["t_u"] / s["tp"]
    elems = (4 * 3 * cfg.hidden * rows_sp + 3 * (s["heads"] + s["kv_heads"]) * cfg.head_dim * s["t_cp"]
             + 5 * cfg.ffn / s["tp"] * s["t_u"])
    t = hw.memory_time(elems * w.elem_bytes)
    return (Part.of(t + KERNELS_PER_BLOCK[0] * hw.gemm_overhead_s),
            Part.of(2 * t + KERNELS_PER_BLOCK[1] * hw.gemm_overhead_s))


# ----------------------------------------------------------------------------------------------
# attention


def attention(w: Workload, peer: Peer) -> list[tuple[float, Part, Part]]:
    """Per cp rank of every pack: (tokens / T_cp, forward Part, backward Part) of one block's attention."""
    from flashpar import cp
    from flashpar.cp.cp_plan import rank_figures

    cfg, s, g = w.cfg, w.sizes(peer), w.groups(peer)
    n, hw = s["cp_size"], g["cp"][1]
    shape = {"hidden": cfg.hidden, "ffn": max(cfg.ffn // s["split"], 1), "heads": s["heads"],
             "kv_heads": s["kv_heads"], "head_dim": cfg.head_dim, "dtype_bytes": w.elem_bytes}
    plan_cost = cp.CostModel(**shape, hardware=w.plan_hardware or hw, burst=w.plan_burst)  # as the trainer plans
    if w.plan_per_step:  # (flashpar.train.planning.planner_cost)
        plan_cost = plan_cost.per_step()
    fwd_cost = cp.CostModel(**shape, hardware=hw, linear=False)
    bwd_cost = cp.CostModel(**shape, hardware=w.bwd_hardware(hw), linear=False)
    out = []
    for lens in w.packs:
        p = _plan(tuple(lens), n, peer.strategy, plan_cost)
        ff = rank_figures(p.segments, p.doc_lens, p.doc_starts, fwd_cost, p.comm)
        fb = rank_figures(p.segments, p.doc_lens, p.doc_starts, bwd_cost, p.comm)
        mean = sum(ff.tokens) / n
        for r in range(n):
            scale = ff.tokens[r] / mean
            if peer.kv == "plan":  # cp.attention: local first, then each peer's K/V as it arrives
                parts = [Part.of(f.compute[r], cp=max(f.compute[r], f.comm[r] + f.remote[r]) - f.compute[r])
                         for f in (ff, fb)]
            else:  # torch: K/V all-gathered (ring, blocking), dK/dV reduce-scattered, then / before the kernel
                kv = max(ff.tokens) * fwd_cost.kv_bytes_per_token
                comm = (n - 1) * hw.transfer_time(kv) if n > 1 else 0.0
                if w.torch_attention == "dense":  # SDPA with a mask: all S_loc x S scores
                    t, total_tokens = ff.tokens[r], sum(ff.tokens)
                    work = t * total_tokens * fwd_cost.flops_per_pair
                    comps = [hw.attn_time(work, t, total_tokens), bwd_cost.hardware.attn_time(work, t, total_tokens)]
                else:
                    comps = [ff.compute[r], fb.compute[r]]
                parts = [Part.of(c, cp=comm) for c in comps]
            out.append((scale, parts[0], parts[1]))
    return out


@functools.lru_cache(maxsize=512)
def _plan(lens: tuple[int, ...], n: int, strategy: str, cost):
    from flashpar import cp

    return cp.plan(list(lens), n, strategy=strategy, cost=cost)


def block(w: Workload, peer: Peer) -> tuple[Part, Part, Part, Part]:
    """(forward, backward, forward compute-only, backward compute-only) of one block on its slowest cp rank
    (forward and backward each take their own slowest).  Where the run's ranks share cores (``shared_cores``
    > 1) a block's compute is when the last of the cp ranks' computes ends with the cores shared fairly
    (``CostModel.compute_span``: a rank that finishes early lends its cores), with the slowest rank's exposures."""
    from flashpar.cp import CostModel

    lin_f, lin_b = linears(w, peer)
    el_f, el_b = elementwise(w, peer, w.cluster.device)
    best = [None, None]
    computes: list[list[float]] = [[], []]
    for scale, af, ab in attention(w, peer):
        for i, (lin, el, a) in enumerate(((lin_f, el_f, af), (lin_b, el_b, ab))):
            part = lin.scaled(scale).add(el, scale).add(a)
            if best[i] is None or part.total > best[i].total:
                best[i] = part
            computes[i].append(part.compute)
    shared = CostModel(burst=w.shared_cores)
    spans = [shared.compute_span(c) for c in computes]  # (burst 1: the slowest rank's; every pack's cp ranks)
    if w.shared_cores != 1:
        for part, span in zip(best, spans, strict=True):
            part.compute = span
    return best[0], best[1], Part.of(spans[0]), Part.of(spans[1])


# ----------------------------------------------------------------------------------------------
# once per step: embedding, head and loss; gradient sums; FSDP; optimizer


def ends(w: Workload, peer: Peer) -> tuple[Part, Part]:
    """(forward, backward) of the embedding, the final norm, the head and the loss."""
    cfg, s, g = w.cfg, w.sizes(peer), w.groups(peer)
    tp, tp_hw = s["tp"], g["tp"][1]
    rows, e, vocab = s["t_u"], w.elem_bytes, cfg.vocab_size // s["tp"]
    fwd, bwd = Part(), Part()
    lookup = tp_hw.memory_time(2 * rows * cfg.hidden * e)
    if gathers_vocab(w, peer):  # each weight gathered (fp32) forward, reduce-scattered backward; own rows whole
        mine, weights = rows / tp, 1 if cfg.tie_embeddings else 2
        move = weights * (tp - 1) * tp_hw.transfer_time(vocab * cfg.hidden * 4)
        gemm = tp_hw.gemm_time(mine, cfg.hidden, cfg.vocab_size)
        loss = tp_hw.memory_time(5 * mine * cfg.vocab_size * 4)
        lookup = tp_hw.memory_time(2 * mine * cfg.hidden * e)
        fwd.add(Part.of(lookup + gemm + loss, tp=move))
        bwd.add(Part.of(lookup + 2 * gemm + loss, tp=move))
        return fwd, bwd
    if tp > 1:  # each tp rank embeds its vocabulary rows of all T_u tokens; reduce-scatter to the rank's rows
        rs = (tp - 1) * tp_hw.transfer_time(rows / tp * cfg.hidden * e)
        fwd.add(Part.of(lookup, tp=rs))
        bwd.add(Part.of(lookup, tp=rs))
        # the loss: three all-reduces over tp of one fp32 per row (row max, sum of exponentials, target logit)
        ar = 3 * all_reduce_time(4 * rows, tp, tp_hw)
        fwd.add(Part.of(0.0, tp=ar))
    else:
        fwd.add(Part.of(lookup))
        bwd.add(Part.of(lookup))
    hf, hb = _op("ag_matmul", peer.mode, tp, rows, cfg.hidden, vocab, e, tp_hw, "tp", head_gathers_again(w, peer))
    loss = tp_hw.memory_time(5 * rows * vocab * 4)  # fp32 logits: max, exp, sum, target, the gradient
    fwd.add(hf).add(Part.of(loss))
    bwd.add(hb).add(Part.of(loss))
    return fwd, bwd


def grad_sums(w: Workload, peer: Peer, bwd_block: float, bwd_head: float, bwd_embed: float) -> float:
    """Exposed seconds of flashpar's gradient sums (``flashpar.models.grad_sync``): posted in backward order
    (head, blocks L-1 .. 0, embedding), each when its gradient is complete, run one after another on a lane;
    what outlasts backward is exposed."""
    cfg, s, g = w.cfg, w.sizes(peer), w.groups(peer)
    tp, d, h = s["tp"], cfg.head_dim, cfg.hidden
    zero = w.layout.dp > 1
    attn = (h * (cfg.heads + 2 * cfg.kv_heads) * d + cfg.heads * d * h)
    mlp = 3 * h * cfg.ffn
    shard_n, shard_hw = g["shard"][:2]
    zero_n, zero_hw = g["zero"][:2]
    all_n, all_hw = g["all"][:2]
    per_block = all_reduce_time(2 * h * 4, all_n, all_hw)  # the two norms, over the whole mesh
    if s["u"] > 1:  # Ulysses: attention projections whole, summed over dp x cp x U; the MLP tp shards
        per_block += all_reduce_time(attn * 4, shard_n, shard_hw)
        proj_tp = mlp
    else:
        proj_tp = (attn + mlp) // tp
    if zero:  # ZeRO rows: reduce-scattered over dp inside the op, summed over cp x U here
        per_block += all_reduce_time(proj_tp / w.layout.dp * 4, zero_n, zero_hw)
    else:
        per_block += all_reduce_time(proj_tp * 4, shard_n, shard_hw)
    table = all_reduce_time(cfg.vocab_size // tp * h * 4, shard_n, shard_hw)
    posts = [(bwd_head, table + all_reduce_time(h * 4, all_n, all_hw))]
    posts += [(bwd_head + (i + 1) * bwd_block, per_block) for i in range(cfg.layers)]
    end = bwd_head + cfg.layers * bwd_block + bwd_embed
    posts.append((end, table if not cfg.tie_embeddings else 0.0))
    lane = 0.0
    for post, dur in posts:
        lane = max(lane, post) + dur
    return max(lane - end, 0.0)


def fsdp(w: Workload, peer: Peer, fwd: list[float], bwd: list[float]) -> float:
    """Exposed seconds of FSDP2 (torch peer) over dp x cp x U: units [embedding, blocks..., (norm, head)], each
    all-gathered before its forward (prefetched one unit ahead: the gather of unit i + 1 starts when unit i's
    starts, if the lane is free) and, resharded after forward, again before its backward ((norm, head) is not
    resharded); each unit's gradients reduce-scattered after its backward on a second lane.  ``fwd`` / ``bwd``:
    the units' times without FSDP."""
    cfg, s, g = w.cfg, w.sizes(peer), w.groups(peer)
    n, hw = g["shard"][:2]
    if n == 1:
        return 0.0
    tp, h = s["tp"], cfg.hidden
    table = cfg.vocab_size // tp * h
    units = [table, *[cfg.block_matmul_params // tp + 2 * h] * cfg.layers, table + h]
    gather = [(n - 1) * hw.transfer_time(p / n * w.elem_bytes) for p in units]
    scatter = [(n - 1) * hw.transfer_time(p / n * w.zero_rs_elem_bytes) for p in units]

    def run(times, gathers, scatters):
        lane = done = rs_lane = prev_start = 0.0
        for i, gt in enumerate(gathers):
            issue = prev_start if w.fsdp_prefetch else done  # one unit ahead, or when the previous one ends
            lane = max(lane, issue) + gt
            begin = max(done, lane)
            done, prev_start = begin + times[i], begin
            if scatters is not None:
                rs_lane = max(rs_lane, done) + scatters[i]
        return max(done, rs_lane)

    t_f = run(fwd, gather, None)
    order_b = list(reversed(range(len(units))))
    gathers_b = [0.0 if i == len(units) - 1 else gather[i] for i in order_b]
    t_b = run([bwd[i] for i in order_b], gathers_b, [scatter[i] for i in order_b])
    return (t_f - sum(fwd)) + (t_b - sum(bwd))


def kv_received(w: Workload, peer: Peer) -> float:
    """Most K/V tokens a cp rank receives per block (the plan's; torch: all the other ranks' tokens)."""
    from flashpar import cp
    from flashpar.cp.cp_plan import rank_figures

    s = w.sizes(peer)
    if s["cp_size"] == 1:
        return 0.0
    if peer.kv == "allgather":
        return w.seq - s["t_cp"]
    cost = cp.CostModel(hidden=w.cfg.hidden, ffn=max(w.cfg.ffn // s["split"], 1), heads=s["heads"],
                        kv_heads=s["kv_heads"], head_dim=w.cfg.head_dim, dtype_bytes=w.elem_bytes,
                        hardware=w.groups(peer)["cp"][1])
    most = 0
    for lens in w.packs:
        p = _plan(tuple(lens), s["cp_size"], peer.strategy, cost)
        most = max(most, max(rank_figures(p.segments, p.doc_lens, p.doc_starts, cost, p.comm).recv_tokens))
    return float(most)


def simulate(w: Workload, peer: Peer) -> dict:
    """One step of ``peer`` on ``w``: times (seconds), exposed communication per parallelism, memory (GB)."""
    from flashpar.sim.memory import local_params, memory

    cfg = w.cfg
    bf, bb, nf, nb = block(w, peer)
    ef, eb = ends(w, peer)
    recompute = bf if w.checkpoint else Part()
    fwd = total([ef.copy().add(bf, cfg.layers)])
    bwd = total([eb.copy().add(bb, cfg.layers).add(recompute, cfg.layers)])
    nocomm = ef.compute + eb.compute + cfg.layers * (nf.compute + nb.compute + (nf.compute if w.checkpoint else 0.0))
    half = eb.total / 2  # the head's share of the ends' backward (the embedding's is the other)
    extra_dp = 0.0
    if peer.data_parallel == "zero3":
        extra_dp = grad_sums(w, peer, bb.total + recompute.total, half, half)
    else:
        fwd_units = [ef.total / 2, *[bf.total] * cfg.layers, ef.total / 2]
        bwd_units = [half, *[bb.total + recompute.total] * cfg.layers, half]
        extra_dp = fsdp(w, peer, fwd_units, bwd_units)
    hw = w.cluster.device
    opt = hw.memory_time(ADAMW_BYTES_PER_PARAM * local_params(w, peer))
    step = fwd.total + bwd.total + extra_dp + opt
    exposed = {k: fwd.exposed[k] + bwd.exposed[k] for k in fwd.exposed}
    exposed["dp"] += extra_dp
    tokens = w.layout.dp * w.seq
    flops = tokens * cfg.flops_per_token(w.keys_per_token)
    mem = memory(w, peer, kv_received(w, peer))
    return {"step_s": step, "no_comm_s": nocomm + opt, "exposed": exposed, "forward_s": fwd.total,
            "backward_s": bwd.total, "optimizer_s": opt, "tokens_per_s": tokens / step,
            "mfu": flops / step / (hw.flops * w.layout.gpus), "memory": mem, "flops": flops}
