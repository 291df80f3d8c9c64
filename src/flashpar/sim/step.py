"""The pieces of one training step of a configuration (``flashpar.sim.peers``) on a workload, from the runtime's
own schedules and plans and the one cost model: a block, the embedding, the head and loss.  How the pieces
line up with the data-parallel lanes is :mod:`flashpar.sim.zero`; the whole step is
:func:`flashpar.sim.predict.simulate`.

Per block (forward; backward mirrored), on the cp rank whose layer takes longest::

    attn_norm, rope, residuals, SwiGLU            elementwise passes at memory bandwidth + kernel launches, as
                                                   the peer's side runs them, compiled or eager
                                                   (flashpar.sim.elementwise)
    qkv    ag_matmul  (tp) | matmul_a2a (U)       flashpar.overlap.simulate.predict: the op's schedule in the
    attention                                      peer's mode, timed on the group's link
    o_proj matmul_rs  (tp) | a2a_matmul (U)
    gate_up ag_matmul, down matmul_rs  (tp; plain GEMMs on T_u rows otherwise)
    ZeRO-3, "fused" block (flashpar.sim.zero): the op's sharded schedule over the shard group S composed with
                     the tp one: compute the larger of the two decompositions' computes, exposures added
                     (they ride different links); a "prefetch" block runs the tp op undivided (its weights
                     arrive whole on the gather lane)
    attention: the peer's plan (flashpar.cp.plan) on every pack, each cp rank timed by the planner's own
               rank_figures (local-first overlap: max(compute, K/V comm + remote compute)); torch: the
               K/V all-gather (NCCL's, blocking) + the kernel (document blocks, or dense S_loc x S); a rank's
               ``batch`` sequences each run the pack's attention
    a rank with more tokens runs its linears longer in proportion (tokens_r / T_cp)
    an ag_matmul's backward reads the x its forward gathered (the trainer's default; torch's DTensor linear),
    or gathers it again (``--regather``, and every fused ZeRO-3 linear): ``gathers_again``

Backward adds what the run recomputes (``block``): every block's forward with activation checkpointing, or
what torchtitan's per-op selective checkpointing recomputes (``selective_recompute``).

Once per step: the vocabulary-parallel embedding (reduce-scatter over tp, exposed) and head (ag_matmul over
tp) with the loss, or, flashpar and baseline with a vocabulary smaller than T_u (``gathers_vocab``), the
weights' all-gathers (reduce-scatters in backward, fp32, exposed) and each rank's own rows against the whole
vocabulary; then gradient clipping and AdamW (``ADAMW_BYTES_PER_PARAM``, ``CLIP_BYTES_PER_PARAM``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from flashpar.cost import Hardware
from flashpar.models.vocab import gathers_weight
from flashpar.overlap.simulate import all_reduce_time
from flashpar.sim.elementwise import elementwise, elementwise_bytes, kernels
from flashpar.sim.parts import Part
from flashpar.sim.peers import Peer, is_torch
from flashpar.sim.workload import Workload

ADAMW_BYTES_PER_PARAM = 28
CLIP_BYTES_PER_PARAM = 12
"""Bytes moved per local parameter by the optimizer: AdamW reads p, g, m, v and writes p, m, v (7 x 4);
gradient clipping (the trainer's default, and torchtitan's ``max_norm``) reads g for the squared norm (4)
and scales it in place (8)."""
NORM_PASS_BYTES_PER_PARAM = 4
"""Of the clipping's bytes, the squared-norm pass: what flashpar's trainer runs on the gradients that have
landed while the last sums travel (``flashpar.sim.zero``)."""

def small_all_reduce_s(nbytes: float, n: int, hw: Hardware) -> float:
    """An all-reduce of one small message over ``n`` ranks of ``hw``'s group (``Hardware.collective``: NCCL's
    pick of ring or tree and protocol on a GPU preset)."""
    return all_reduce_time(nbytes, n, hw) if n > 1 else 0.0


def norm_sums(w: Workload, peer: Peer, norms: int) -> Part:
    """The torch peers' sums of ``norms`` RMSNorm weight gradients over tp: DTensor's SequenceParallel norm
    holds a Replicate weight whose gradient, summed over the rank's rows, is Partial and is all-reduced over tp
    in backward, one small blocking all-reduce per norm (compute dtype).  flashpar sums every norm's gradient
    once, at the end of backward (``flashpar.sim.zero``)."""
    tp, tp_hw = w.sizes(peer)["tp"], w.groups(peer)["tp"][1]
    if not is_torch(peer) or tp == 1:
        return Part()
    t = norms * small_all_reduce_s(w.cfg.hidden * w.elem_bytes, tp, tp_hw)
    return Part.of(0.0, {"tp": t}, tp=t)


# ----------------------------------------------------------------------------------------------
# the linears


def _op(op: str, mode: str, n: int, rows: float, n_in: int, n_out: int, elem: int, hw: Hardware,
        key: str, regather: bool = True, split: bool = True) -> tuple[Part, Part]:
    """(forward, backward) of one linear: its schedule over ``n`` ranks (plain GEMMs when ``n == 1``);
    ``regather``: an ``ag_matmul``'s backward gathers ``x`` again (else it reads the forward's copy); mode
    ``auto``: the runtime's picks for the op (``flashpar.overlap.simulate.choose_modes`` on ``hw``), the
    directions apart where the runtime runs them apart (``split``: the plain tp ops, not ZeRO-3's fused ones)."""
    rows = max(int(round(rows)), 1)
    if n == 1:
        fwd = hw.gemm_time(rows, n_in, n_out)
        return Part.of(fwd), Part.of(2 * fwd)
    if mode == "auto":  # (merged pieces where the op's schedules take them: flashpar.overlap.simulate.candidates)
        from flashpar.overlap.simulate import choose_modes

        fwd, bwd = choose_modes(op, n, rows, n_in, n_out, elem, "cuda", hw, regather=regather, split=split)
        return (_predicted(op, *fwd[:2], n, rows, n_in, n_out, elem, hw, key, regather, fwd[2])[0],
                _predicted(op, *bwd[:2], n, rows, n_in, n_out, elem, hw, key, regather, bwd[2])[1])
    return _predicted(op, mode, 1, n, rows, n_in, n_out, elem, hw, key, regather)


@functools.lru_cache(maxsize=4096)
def _predicted(op, mode, chunks, n, rows, n_in, n_out, elem, hw, key, regather, pieces=1) -> tuple[Part, Part]:
    from flashpar.overlap.simulate import predict

    t = predict(op, mode, chunks, n, rows, n_in, n_out, elem, hw, regather=regather, peers_per_piece=pieces)
    f, b = t[op], t[f"{op}_bwd"]
    return (Part.of(f.compute, {key: f.comm}, **{key: f.total - f.compute}),
            Part.of(b.compute, {key: b.comm}, **{key: b.total - b.compute}))


def _with_zero(inner: tuple[Part, Part], zero: tuple[Part, Part], plain: tuple[Part, Part]) -> tuple[Part, Part]:
    """An op of ``inner`` (the tp / plain schedule) whose weight ZeRO-3 gathers inside the op (``zero``: the
    sharded schedule in the same mode, ``plain``: in mode none).  The compute is the inner one plus what
    cutting the GEMM into shard pieces costs (``zero - plain``: the sharded model times its GEMMs by weight
    rows, so only the difference of the two modes is the decomposition's); the exposures of both are added
    (different links)."""
    out = []
    for a, z, p in zip(inner, zero, plain, strict=True):
        part = Part(a.compute + max(z.compute - p.compute, 0.0))
        part.add(Part(0.0, a.exposed, a.sent)).add(Part(0.0, z.exposed, z.sent))
        out.append(part)
    return out[0], out[1]


def head_gathers_again(w: Workload, peer: Peer) -> bool:
    """Whether the head's all-gather + GEMM gathers its input again in backward: only with ``--regather``
    (torch's DTensor linear keeps its input)."""
    return w.regather and not is_torch(peer)


def gathers_vocab(w: Workload, peer: Peer) -> bool:
    """Whether the tp ranks gather the embedding and head weights instead of moving the activations: flashpar
    and baseline where the vocabulary is smaller than the rank's tokens (``flashpar.models.vocab.gathers_weight``,
    on the mean T_u); torch's vocabulary-parallel plans always move the activations."""
    s = w.sizes(peer)
    return w.gather_vocab and not is_torch(peer) and gathers_weight(w.cfg.vocab_size, s["t_u"], s["tp"])


def gathers_again(w: Workload, peer: Peer, fused: bool = False) -> bool:
    """Whether a block's column-parallel linear gathers its input again in backward: as the head does, and a
    fused ZeRO-3 block's linears always (``flashpar.models.zero``); a prefetched block runs the plain tp op,
    which keeps its gathered input."""
    return head_gathers_again(w, peer) or fused


@dataclass(frozen=True)
class LinearCall:
    """One linear of a block as the runtime's op asks ``mode="auto"`` for its picks (``flashpar.overlap.call
    .pick_mode``): the op, its group's size and figures, the gathered rows, the GEMM's width, element size,
    whether its backward gathers ``x`` again and whether its directions are picked apart."""

    op: str
    n: int
    rows: int
    n_in: int
    n_out: int
    elem: int
    hw: Hardware
    key: str
    regather: bool = True
    split: bool = True

    def picks(self):
        """The runtime's (forward, backward) picks for this call (``choose_modes``; a group of one: none)."""
        from flashpar.overlap.simulate import choose_modes

        if self.n == 1:
            return ("none", 1, 1), ("none", 1, 1)
        return choose_modes(self.op, self.n, self.rows, self.n_in, self.n_out, self.elem, "cuda", self.hw,
                            regather=self.regather, split=self.split)


def linear_calls(w: Workload, peer: Peer, fused: bool = False, rows: float | None = None) -> list[LinearCall]:
    """A block's four linears (q/k/v, o, gate/up, down) as :class:`LinearCall`, on a rank of ``rows`` gathered
    rows (``None``: the mean, ``T_u``); the shapes ``flashpar.models.parallel`` calls its ops with."""
    cfg, s, g = w.cfg, w.sizes(peer), w.groups(peer)
    h, d, f, tp, u = cfg.hidden, cfg.head_dim, cfg.ffn, s["tp"], s["u"]
    e = w.elem_bytes
    scale = 1.0 if rows is None else rows / s["t_u"]
    t_u, t_cp = (max(int(round(x * scale)), 1) for x in (s["t_u"], s["t_cp"]))
    regather = gathers_again(w, peer, fused)
    split = not (fused and g["shard"][0] > 1)  # a fused ZeRO-3 linear runs one pick both ways (overlap.sharded)
    if fused and u > 1:
        raise ValueError("a fused ZeRO-3 block needs ulysses = 1 (the attention projections are whole there)")
    tp_n, tp_hw = g["tp"][:2]
    calls = []
    if u > 1:  # Ulysses: the projections whole, fused with the all-to-alls
        u_hw = g["ulysses"][1]
        calls.append(LinearCall("matmul_a2a", u, t_cp, h, (s["heads"] + 2 * s["kv_heads"]) * d, e, u_hw, "ulysses"))
        calls.append(LinearCall("a2a_matmul", u, t_cp, s["heads"] * d, h, e, u_hw, "ulysses"))
    else:
        calls.append(LinearCall("ag_matmul", tp, t_u, h, (cfg.heads + 2 * cfg.kv_heads) * d // tp, e, tp_hw, "tp",
                                regather, split))
        calls.append(LinearCall("matmul_rs", tp, t_u, cfg.heads * d // tp, h, e, tp_hw, "tp", True, split))
    calls.append(LinearCall("ag_matmul", tp, t_u, h, 2 * f // tp, e, tp_hw, "tp", regather, split))
    calls.append(LinearCall("matmul_rs", tp, t_u, f // tp, h, e, tp_hw, "tp", True, split))
    return calls


def linears(w: Workload, peer: Peer, fused: bool = False, rows: float | None = None) -> tuple[Part, Part]:
    """(forward, backward) of one block's four linears (:func:`linear_calls`) on a rank of ``rows`` gathered rows
    (``None``: the mean ``T_u``); ``fused``: each composed with ZeRO-3's sharded schedule over the shard group
    (``flashpar.sim.zero``; needs U = 1)."""
    g, e, mode = w.groups(peer), w.elem_bytes, peer.mode
    shard_n, shard_hw = g["shard"][:2]
    fwd, bwd = Part(), Part()
    mean = max(int(round(w.sizes(peer)["t_u"])), 1)
    for c in linear_calls(w, peer, fused, rows):
        of, ob = _op(c.op, mode, c.n, c.rows, c.n_in, c.n_out, c.elem, c.hw, c.key, c.regather, c.split)
        if fused and shard_n > 1:  # (the shard group's schedule on the mean rows, the same on every rank of it)
            n_in, n_out = c.n_in, c.n_out
            zb_elem = (e + w.zero_rs_elem_bytes) // 2  # backward: the weight gathered again, the fp32 gradient out
            zf = _op("sharded", mode, shard_n, mean, n_in, n_out, e, shard_hw, "dp")[0]
            zb = _op("sharded", mode, shard_n, mean, n_in, n_out, zb_elem, shard_hw, "dp")[1]
            pf, pb = _op("sharded", "none", shard_n, mean, n_in, n_out, e, shard_hw, "dp")
            of, ob = _with_zero((of, ob), (zf, zb), (pf, pb))
        fwd.add(of)
        bwd.add(ob)
    if is_torch(peer):
        sf, sb = separate_projections(w, peer, rows)
        fwd.add(sf)
        bwd.add(sb)
    return fwd, bwd


def separate_projections(w: Workload, peer: Peer, rows: float | None = None) -> tuple[Part, Part]:
    """What torchtitan's Llama adds to :func:`linears`' GEMMs by projecting q, k, v and w1, w3 with separate
    linears (one all-gather feeds each group under tp): forward ``sum_i t(m, k, n_i) - t(m, k, sum_i n_i)``,
    backward the same for the input gradient (``t(m, n_i, k)``) and the weight gradient (``t(n_i, m, k)``), on
    a rank of ``rows`` gathered rows (``Hardware.gemm_time``: a narrow GEMM is bounded by its activations' traffic,
    so a tp shard of the k / v projection costs more than its share of the fused one)."""
    cfg, s = w.cfg, w.sizes(peer)
    hw = w.cluster.device
    m = max(int(round(s["t_u"] if rows is None else rows)), 1)
    tp, h, d = s["tp"], cfg.hidden, cfg.head_dim
    fwd = bwd = 0.0
    for k, parts in ((h, [s["heads"] * d, s["kv_heads"] * d, s["kv_heads"] * d]), (h, [cfg.ffn // tp] * 2)):
        whole = sum(parts)
        fwd += sum(hw.gemm_time(m, k, n) for n in parts) - hw.gemm_time(m, k, whole)
        bwd += sum(hw.gemm_time(m, n, k) + hw.gemm_time(n, m, k) for n in parts)
        bwd -= hw.gemm_time(m, whole, k) + hw.gemm_time(whole, m, k)
    return Part.of(max(fwd, 0.0)), Part.of(max(bwd, 0.0))


def selective_recompute(w: Workload, peer: Peer) -> Part:
    """What torchtitan's per-op selective checkpointing recomputes of one block in backward, at the mean rows.

    Its policy saves the outputs of the attention kernel, of the reduce-scatters and of every other ``mm``
    (counted in the block's order q, k, v, o, w1, w3, w2: the 1st, 3rd, 5th, 7th are saved), and recomputes
    the rest where backward needs it: the k and w3 GEMMs (their outputs feed rope / SDPA and SwiGLU's
    backward), the o GEMM without tp (the residual ``h = x + o`` feeds the MLP norm's backward; with tp the
    reduce-scatter's output is saved and the GEMM's is not needed), every elementwise op of the forward, and
    with tp the all-gathers of the two norms' outputs that the recomputed GEMMs read (in the peer's mode, as
    ag_matmul ops of those GEMMs).  Ulysses: the same GEMMs on the rank's rows, without the all-to-alls."""
    cfg, s, g = w.cfg, w.sizes(peer), w.groups(peer)
    h, d, f, tp, rows, e = cfg.hidden, cfg.head_dim, cfg.ffn, s["tp"], s["t_u"], w.elem_bytes
    hw = w.cluster.device
    out = Part.of(hw.memory_time(elementwise_bytes(w, peer)) + kernels(w, peer)[0] * hw.gemm_overhead_s)
    kv = (s["kv_heads"] if s["u"] > 1 else cfg.kv_heads // tp) * d
    rows_i = max(int(round(rows)), 1)
    if tp > 1:
        tp_hw = g["tp"][1]
        out.add(_op("ag_matmul", peer.mode, tp, rows, h, kv, e, tp_hw, "tp")[0])
        out.add(_op("ag_matmul", peer.mode, tp, rows, h, f // tp, e, tp_hw, "tp")[0])
    else:
        out.add(Part.of(hw.gemm_time(rows_i, h, kv) + hw.gemm_time(rows_i, h, f)
                        + hw.gemm_time(rows_i, s["heads"] * d, h)))
    return out


# ----------------------------------------------------------------------------------------------
# attention


def attention(w: Workload, peer: Peer) -> list[tuple[float, Part, Part]]:
    """Per cp rank of every pack: (tokens / T_cp, forward Part, backward Part) of one block's attention over
    the rank's ``batch`` sequences."""
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
                parts = [Part.of(f.compute[r], {"cp": f.comm[r]},
                                 cp=max(f.compute[r], f.comm[r] + f.remote[r]) - f.compute[r]) for f in (ff, fb)]
            else:  # torch: K/V all-gathered (NCCL, blocking), dK/dV reduce-scattered, then / before the kernel
                kv = max(ff.tokens) * fwd_cost.kv_bytes_per_token
                comm = hw.collective("all_gather", n, n * kv).total_s
                if w.torch_attention == "dense":  # SDPA with a mask: all S_loc x S scores
                    t, total_tokens = ff.tokens[r], sum(ff.tokens)
                    work = t * total_tokens * fwd_cost.flops_per_pair
                    comps = [hw.attn_time(work, t, total_tokens), bwd_cost.hardware.attn_time(work, t, total_tokens)]
                elif w.torch_attention == "docs":  # SDPA per (document, chunk): its masked rectangle
                    calls = chunk_calls(p.segments[r], p.doc_lens, p.doc_starts, n)
                    comps = [sum(h.attn_time(pairs * fwd_cost.flops_per_pair, q, k) for q, k, pairs in calls)
                             for h in (hw, bwd_cost.hardware)]
                else:  # FlexAttention over document blocks: each piece against its document's keys, in one kernel
                    comps = [flex_time(p.segments[r], p.doc_starts, c) for c in (fwd_cost, bwd_cost)]
                parts = [Part.of(c, {"cp": comm}, cp=comm) for c in comps]
            out.append((scale, parts[0].scaled(w.batch), parts[1].scaled(w.batch)))
    return out


def flex_time(pieces, doc_starts, cost) -> float:
    """The torch peer's ``flex`` kernel on one cp rank: FlexAttention's block mask visits, for every piece ``[a, b)``
    of a document from ``s``, its causal pairs against the keys ``[s, b)`` in the one kernel, at the efficiency of
    ``b - a`` queries over ``b - s`` keys (``cost.attn_time``; not flashpar's segment tasks, whose calls
    ``flashpar.cp.cp_plan.rank_figures`` charges)."""
    import bisect

    t = 0.0
    for a, b in pieces:
        s = doc_starts[bisect.bisect_right(doc_starts, a) - 1]
        t += cost.attn_time((b - a) * (a + b - 2 * s + 1) // 2, b - a, b - s)
    return t


def chunk_calls(pieces, doc_lens, doc_starts, n: int) -> list[tuple[int, int, int]]:
    """``(queries, keys, pairs computed)`` of each SDPA call of the torch peer's ``docs`` kernel on one cp rank
    (``flashpar.bench.torch_attention``): every piece ``[a, b)`` cut at its document's chunk boundaries (``n_d /
    (2 n)``, where ``n > 1``), each chunk's ``L`` queries against the document's keys ``[s, a + L)``; torch's CPU
    flash kernel visits the whole ``L x (a + L - s)`` rectangle under a mask, and half the square with
    ``is_causal`` (a document's first chunk)."""
    import bisect

    out = []
    for a, b in pieces:
        d = bisect.bisect_right(doc_starts, a) - 1
        s, nd = doc_starts[d], doc_lens[d]
        step = max(nd // (2 * n), 1) if n > 1 else nd
        x = a
        while x < b:
            end = min(b, s + ((x - s) // step + 1) * step)
            q, k = end - x, end - s
            out.append((q, k, q * (q + 1) // 2 if x == s else q * k))
            x = end
    return out


@functools.lru_cache(maxsize=512)
def _plan(lens: tuple[int, ...], n: int, strategy: str, cost):
    from flashpar import cp

    return cp.plan(list(lens), n, strategy=strategy, cost=cost)


def block(w: Workload, peer: Peer, fused: bool = False) -> tuple[Part, Part, Part, Part]:
    """(forward, backward, forward compute-only, backward compute-only) of one block on its slowest cp rank
    (forward and backward each take their own slowest); backward includes what the run recomputes
    (``Workload.checkpoint_activations``: the rank's forward; ``Workload.selective``: ``selective_recompute``).
    Where the run's ranks share cores (``shared_cores`` > 1) a block's compute is when the last of the cp ranks'
    computes ends with the cores shared fairly (``CostModel.compute_span``: a rank that finishes early lends
    its cores), with the slowest rank's exposures."""
    from flashpar.cp import CostModel

    lin_f, lin_b = linears(w, peer, fused)
    el_f, el_b = elementwise(w, peer, w.cluster.device)
    sums = norm_sums(w, peer, 2)
    sac = selective_recompute(w, peer) if w.selective else None
    best = [None, None]
    computes: list[list[float]] = [[], []]
    t_u = w.sizes(peer)["t_u"]
    for scale, af, ab in attention(w, peer):
        if peer.mode == "auto":  # each rank picks on its own rows, as the runtime's ops do (check=False)
            rf, rb = linears(w, peer, fused, scale * t_u)
        else:
            rf, rb = lin_f.scaled(scale), lin_b.scaled(scale)
        fwd = rf.add(el_f, scale).add(af)
        bwd = rb.add(el_b, scale).add(ab).add(sums)
        if w.checkpoint_activations:
            bwd.add(fwd)
        elif sac is not None:
            bwd.add(sac, scale)
        for i, part in enumerate((fwd, bwd)):
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
# once per step: embedding, head and loss


def ends(w: Workload, peer: Peer) -> tuple[tuple[Part, Part], tuple[Part, Part]]:
    """((forward, backward) of the embedding, (forward, backward) of the final norm, the head and the loss)."""
    cfg, s, g = w.cfg, w.sizes(peer), w.groups(peer)
    tp, tp_hw = s["tp"], g["tp"][1]
    rows, e, vocab = s["t_u"], w.elem_bytes, cfg.vocab_size // s["tp"]
    lookup = tp_hw.memory_time(2 * rows * cfg.hidden * e)
    if gathers_vocab(w, peer):  # each weight gathered (fp32) forward, reduce-scattered backward; own rows whole
        mine = rows / tp
        move = tp_hw.collective("all_gather", tp, tp * vocab * cfg.hidden * 4).total_s  # one weight (tied: one
        #                                                                                 gather feeds both)
        head_move = 0.0 if cfg.tie_embeddings else move
        gemm = tp_hw.gemm_time(mine, cfg.hidden, cfg.vocab_size)
        loss = tp_hw.memory_time(5 * mine * cfg.vocab_size * 4)
        lookup = tp_hw.memory_time(2 * mine * cfg.hidden * e)
        embed = (Part.of(lookup, {"tp": move}, tp=move), Part.of(lookup, {"tp": move}, tp=move))
        head = (Part.of(gemm + loss, {"tp": head_move}, tp=head_move),
                Part.of(2 * gemm + loss, {"tp": head_move}, tp=head_move))
        return embed, head
    hf, hb = _op("ag_matmul", peer.mode, tp, rows, cfg.hidden, vocab, e, tp_hw, "tp", head_gathers_again(w, peer))
    loss = tp_hw.memory_time(5 * rows * vocab * 4)  # fp32 logits: max, exp, sum, target, the gradient
    head_f, head_b = hf.copy().add(Part.of(loss)), hb.copy().add(Part.of(loss)).add(norm_sums(w, peer, 1))
    if tp > 1:  # each tp rank embeds its vocabulary rows of all T_u tokens; reduce-scatter to the rank's rows
        rs = tp_hw.collective("reduce_scatter", tp, rows * cfg.hidden * e).total_s
        # the loss: three all-reduces over tp of one fp32 per row (row max, sum of exponentials, target logit)
        sums = 3 * all_reduce_time(4 * rows, tp, tp_hw)
        head_f.add(Part.of(0.0, {"tp": sums}, tp=sums))
        return (Part.of(lookup, {"tp": rs}, tp=rs), Part.of(lookup, {"tp": rs}, tp=rs)), (head_f, head_b)
    return (Part.of(lookup), Part.of(lookup)), (head_f, head_b)


def kv_received(w: Workload, peer: Peer) -> float:
    """Most K/V tokens a cp rank receives per block over its ``batch`` sequences (the plan's; torch: all the
    other ranks' tokens)."""
    from flashpar import cp
    from flashpar.cp.cp_plan import rank_figures

    s = w.sizes(peer)
    if s["cp_size"] == 1:
        return 0.0
    if peer.kv == "allgather":
        return w.batch * w.seq - s["t_cp"]
    cost = cp.CostModel(hidden=w.cfg.hidden, ffn=max(w.cfg.ffn // s["split"], 1), heads=s["heads"],
                        kv_heads=s["kv_heads"], head_dim=w.cfg.head_dim, dtype_bytes=w.elem_bytes,
                        hardware=w.groups(peer)["cp"][1])
    most = 0
    for lens in w.packs:
        p = _plan(tuple(lens), s["cp_size"], peer.strategy, cost)
        most = max(most, max(rank_figures(p.segments, p.doc_lens, p.doc_starts, cost, p.comm).recv_tokens))
    return float(w.batch * most)
