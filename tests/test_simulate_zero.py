"""The simulator's ZeRO-3 / FSDP2 lanes (``flashpar.sim.zero``), the run settings of ``flashpar.sim.step`` (batch,
selective checkpointing, eager elementwise) and torch_async_tp: pure Python, checked by hand where possible."""

from __future__ import annotations

import dataclasses
import math

import pytest

from flashpar.cost import preset
from flashpar.models.config import LlamaConfig
from flashpar.sim import step, zero
from flashpar.sim.model_configs import load_model
from flashpar.sim.peers import PEERS
from flashpar.sim.predict import simulate
from flashpar.sim.topology import Cluster, Layout
from flashpar.sim.workload import Workload

H100 = Cluster(preset("h100-nvlink"), preset("h100-ib"))
TINY = LlamaConfig(vocab_size=64, hidden=16, layers=2, heads=4, kv_heads=2, ffn=32, tie_embeddings=False)
NORMS = 2 * 2 * 16 + 16  # two per block, the final one: whole on every rank


def _w(layout: Layout, cfg: LlamaConfig = TINY, **kw) -> Workload:
    return Workload(cfg, layout, H100, ((64,),), elem_bytes=2, **kw)


def test_local_params_are_split_over_the_shard_group():
    """S = dp x cp x U ranks of one tp index: (2 blocks x 2304 / tp + 2 tables x 64 x 16 / tp) / |S| + norms."""
    fp = PEERS["flashpar"]
    assert zero.local_params(_w(Layout(2, 2, 1, 2)), fp) == (2 * 1152 + 2 * 512) / 4 + NORMS == 912
    # Ulysses: the projections whole (tp 1), split over the 2 ulysses ranks like dp
    assert zero.local_params(_w(Layout(1, 1, 2, 1)), fp) == (2 * 2304 + 2 * 1024) / 2 + NORMS
    # no dp, cp or Ulysses: nothing to split
    assert zero.local_params(_w(Layout(1, 1, 1, 2)), fp) == 2 * 1152 + 2 * 512 + NORMS
    # tied embeddings: one table
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    assert zero.local_params(_w(Layout(2, 2, 1, 2), tied), fp) == (2 * 1152 + 512) / 4 + NORMS
    # torch's FSDP2 shards everything, the norms too
    assert zero.local_params(_w(Layout(2, 2, 1, 2)), PEERS["torch"]) == TINY.params / 2 / 4


# the module docstring's example: embedding, two blocks, head (forward, backward, gather, scatter, kept)
UNITS = [zero.Unit(1, 1, 2, 1), zero.Unit(4, 8, 3, 2), zero.Unit(4, 8, 3, 2, kept=True),
         zero.Unit(2, 3, 2, 1, kept=True)]


def test_prefetch_timeline_by_hand():
    """K = 1.  Forward: gathers 0 [0, 2] and 1 [2, 5] posted at the start; unit 0 runs [2, 3]; unit 1 waits
    for its gather, runs [5, 9] and posts 2 [5, 8]; unit 2 [9, 13] posts 3 [9, 11]; unit 3 [13, 15].  Backward
    (3, 2, 1, 0; 3 and 2 kept): 3 [15, 18]; 2 [18, 26] posts 1 again [18, 21]; 1 [26, 34] posts 0 [26, 28];
    0 [34, 35]; reduce-scatters 3 [18, 19], 2 [26, 28], 1 [34, 36], 0 [36, 37], on the gathers' lane (the rank's
    one port: gather 1 again queues behind reduce-scatter 3, [19, 22], and is still in time)."""
    ln = zero.lanes(UNITS, ahead=1)
    assert (ln.fwd_end, ln.bwd_end, ln.scatter_end, ln.exposed) == (15, 35, 37, 4)
    # K = 0, blocking (baseline): every gather when the unit needs it, every reduce-scatter waited for
    # forward: 0 [2, 3], gather 1 [3, 6] -> [6, 10], gather 2 [10, 13] -> [13, 17], gather 3 [17, 19] -> [19, 21]
    # backward: 3 [21, 24] + rs 1 -> 25; 2 [25, 33] + 2 -> 35; gather 1 [35, 38], 1 [38, 46] + 2 -> 48;
    # gather 0 [48, 50], 0 [50, 51] + 1 -> 52
    ln = zero.lanes(UNITS, ahead=0, blocking=True)
    assert (ln.fwd_end, ln.bwd_end, ln.scatter_end, ln.exposed) == (21, 52, 52, 52 - 31)
    # K = 0, the reduce-scatters not waited for (torch's FSDP2 without prefetch), on the gathers' port: backward
    # 3 [21, 24] rs [24, 25], 2 [24, 32] rs [32, 34], gather 1 queued behind it [34, 37] -> 1 [37, 45] rs [45, 47],
    # gather 0 [47, 49] -> 0 [49, 50] rs [50, 51]
    ln = zero.lanes(UNITS, ahead=0)
    assert (ln.fwd_end, ln.bwd_end, ln.scatter_end, ln.exposed) == (21, 50, 51, 10 + 5 + 4)
    # the units' own transfers on the port go first: 3 s of unit 1's forward delay the gather of unit 2
    # posted as unit 1 starts (K = 1): 2 [8, 11] instead of [5, 8], unit 2 waits 2 and the rest follows
    busy = [UNITS[0], dataclasses.replace(UNITS[1], port_fwd=3.0), *UNITS[2:]]
    ln = zero.lanes(busy, ahead=1)
    assert (ln.fwd_end, ln.exposed) == (17, 4 + 2)


def test_an_embedding_whose_backward_needs_no_weight_is_not_gathered_again():
    """The docstring's example with unit 0 (flashpar's untied embedding: its lookup saves only indices) not
    gathered again: unit 2's backward start posts only unit 1's gather [18, 21]; unit 1's posts nothing; unit
    0 [34, 35] runs at once.  The same times as with its gather (that one was hidden), one message fewer; with
    K = 0 blocking, unit 0's backward no longer waits 2 for it."""
    units = [dataclasses.replace(UNITS[0], regather=False), *UNITS[1:]]
    ln = zero.lanes(units, ahead=1)
    assert (ln.fwd_end, ln.bwd_end, ln.scatter_end, ln.exposed) == (15, 35, 37, 4)
    ln = zero.lanes(units, ahead=0, blocking=True)
    assert (ln.fwd_end, ln.bwd_end, ln.exposed) == (21, 50, 50 - 31)


def test_auto_is_never_slower_than_its_candidates():
    """flashpar's auto schedule: the fastest of its three candidates (the whole step simulated for each) where it
    beats every block prefetched by more than ``ZERO_AUTO_MARGIN``, else every block prefetched.  8B at dp 4 x
    tp 2 (4,096 tokens): on a 10 GB/s link fusing block 0 hides the gather nothing runs ahead of and wins by
    2.2%; on 100 GB/s by 1.1%, inside the margin."""
    peer = PEERS["flashpar"]
    for rate, fused in ((10e9, True), (100e9, False)):
        hw = dataclasses.replace(preset("h100-96gb"), link_bytes_per_s=rate)
        w = Workload(load_model("llama3-8b"), Layout(4, 1, 1, 2), Cluster(hw, hw), ((4096,),))
        cands = zero.candidates(w, peer)
        assert [c.count(zero.FUSED) for c in cands] == [0, 1, 32] and cands[1][0] == zero.FUSED
        steps = [simulate(w, peer, c)["step_s"] for c in cands]
        auto = simulate(w, peer)
        assert min(steps) == steps[1] and (steps[1] < zero.ZERO_AUTO_MARGIN * steps[0]) == fused, (rate, steps)
        assert auto["step_s"] == (steps[1] if fused else steps[0])
        assert zero.zero_schedule(w, peer) == auto["schedule"] == (cands[1] if fused else cands[0])
    assert zero.zero_schedule(w, PEERS["baseline"]) == (zero.PREFETCH,) * 32  # mode none: K = 0, no choice
    with pytest.raises(ValueError, match="FSDP2"):
        zero.zero_schedule(w, PEERS["torch"])
    with pytest.raises(ValueError, match="one of"):
        simulate(w, peer, (zero.PREFETCH,) * 3)
    u = Workload(load_model("llama3-8b"), Layout(2, 1, 2, 1), H100, ((4096,),))  # Ulysses: prefetch only
    assert zero.candidates(u, peer) == [(zero.PREFETCH,) * 32]


def test_tied_embeddings_are_one_unit_kept_from_forward_to_the_end_of_backward():
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    for cfg, first_kept in ((tied, True), (TINY, False)):
        w = _w(Layout(2, 1, 1, 2), cfg)
        peer = PEERS["flashpar"]
        units = zero._units(w, peer, (zero.PREFETCH,) * 2, zero._Pieces(w, peer))
        table = zero.gather_s(w, peer, 64 * 16 / 2)
        assert units[0].kept == first_kept and units[0].gather == table > 0 and units[0].scatter > 0
        assert units[2].kept and not units[1].kept  # the last block is kept, the first gathered again
        if first_kept:  # the head computes on the one table: nothing of its own on the lanes
            assert units[-1].gather == units[-1].scatter == 0
        else:
            assert units[-1].kept and units[-1].gather == table
    # the table unit gathered once: forward waits for it, backward gathers only block 0 again
    w = _w(Layout(2, 1, 1, 2), tied)
    assert zero.data_parallel(w, PEERS["flashpar"]).exposed > 0


def test_the_baseline_blocks_and_its_tail_is_the_norm_sum():
    """Mode none: every reduce-scatter waited for inside backward, so the tail is the norms' all-reduce over the
    whole mesh (80 fp32 gradients), not overlapped; flashpar's tail overlaps the squared-norm pass."""
    w = _w(Layout(2, 2, 1, 2))
    all_n, all_hw = w.groups(PEERS["baseline"])["all"][:2]
    assert all_n == 8
    assert simulate(w, PEERS["baseline"])["tail_s"] == pytest.approx(step.small_all_reduce_s(NORMS * 4, 8, all_hw))
    slow_memory = dataclasses.replace(w, cluster=Cluster(dataclasses.replace(preset("h100-nvlink"),
                                                                              memory_bytes_per_s=1e3), H100.inter))
    assert simulate(slow_memory, PEERS["flashpar"])["tail_s"] == 0.0  # the norm pass outlasts the tail


def test_small_all_reduce_is_nccls_pick_on_the_groups_nodes():
    from flashpar.cost import group_hardware

    hw = group_hardware(preset("h100-nvlink"), preset("h100-ib"), range(512), 8)  # 64 nodes
    got = step.small_all_reduce_s(1e6, 512, hw)
    assert got == pytest.approx(hw.collective("all_reduce", 512, 1e6).total_s)
    assert hw.collective("all_reduce", 512, 1e6).algorithm == "tree"  # log2(64) network steps, not 126
    assert step.small_all_reduce_s(1e6, 1, hw) == 0.0


def test_the_torch_peers_sum_each_norm_over_tp_and_flashpar_once():
    w = _w(Layout(1, 1, 1, 2))
    tp_hw = w.groups(PEERS["torch"])["tp"][1]
    one = step.small_all_reduce_s(16 * 2, 2, tp_hw)
    assert step.norm_sums(w, PEERS["torch"], 2).exposed["tp"] == pytest.approx(2 * one)
    assert step.norm_sums(w, PEERS["flashpar"], 2).total == 0.0
    assert step.norm_sums(_w(Layout(2, 1, 1, 1)), PEERS["torch"], 2).total == 0.0  # tp 1: nothing to sum


def test_selective_recompute_by_hand():
    """torchtitan's per-op policy: the k, w3 and (tp 1) o GEMMs again, and the block's forward elementwise work
    (64 rows: k 16 -> 2 x 4, w3 16 -> 32, o 16 -> 16)."""
    w = _w(Layout(1, 1, 1, 1), selective=True)
    hw = w.cluster.device
    by_hand = (hw.gemm_time(64, 16, 8) + hw.gemm_time(64, 16, 32) + hw.gemm_time(64, 16, 16)
               + hw.memory_time(step.elementwise_bytes(w, PEERS["torch"])) + 16 * hw.gemm_overhead_s)
    assert step.selective_recompute(w, PEERS["torch"]).total == pytest.approx(by_hand)
    full, sac, none = (step.block(dataclasses.replace(w, checkpoint_activations=c, selective=s),
                                  PEERS["torch"])[1].total for c, s in ((True, False), (False, True), (False, False)))
    assert none < sac < full
    with pytest.raises(ValueError, match="exclude"):
        _w(Layout(1, 1, 1, 1), selective=True, checkpoint_activations=True)


def test_eager_elementwise_bytes_by_hand():
    """Per token (bf16; h 16, 4 q and 2 kv heads of 4, ffn 32): fused 2 norms x 3 passes x 2 bytes x 16 (192),
    2 residual adds (192), rope 3 x 2 x 24 (144), SwiGLU 5 x 2 x 32 (320); eager torch (torchtitan without
    torch.compile) norms 2 x 36 x 16 (1152), rope 20 x 24 (480), repeat_kv 2 x 2 x 24 (96), the attention
    output's copy 2 x 2 x 16 (64); eager flashpar (its kernels, without --compile) norms 2 x 44 x 16 (1408), rope
    5 x 2 x 24 (240) and v's copy 2 x 2 x 8 (32)."""
    w = _w(Layout(1, 1, 1, 1))
    eager = dataclasses.replace(w, torch_compiled=False, flashpar_compiled=False)
    assert step.elementwise_bytes(w, PEERS["torch"]) == 64 * (192 + 192 + 144 + 320)
    assert step.elementwise_bytes(w, PEERS["flashpar"]) == 64 * (192 + 192 + 144 + 320)
    assert step.elementwise_bytes(eager, PEERS["torch"]) == 64 * (1152 + 192 + 480 + 96 + 64 + 320)
    assert step.elementwise_bytes(eager, PEERS["flashpar"]) == 64 * (1408 + 192 + 240 + 32 + 320)
    assert step.elementwise_bytes(eager, PEERS["baseline"]) == step.elementwise_bytes(eager, PEERS["flashpar"])
    # each side follows its own knob
    assert step.elementwise_bytes(dataclasses.replace(w, torch_compiled=False), PEERS["flashpar"]) == \
        step.elementwise_bytes(w, PEERS["flashpar"])
    assert step.elementwise_bytes(dataclasses.replace(w, flashpar_compiled=False), PEERS["torch"]) == \
        step.elementwise_bytes(w, PEERS["torch"])


def test_flashpar_eager_rmsnorm_is_its_kernels_not_the_fused_passes():
    """flashpar's RMSNorm without --compile is eight ops and the caller's cast: per element in bf16 x.to(fp32) 6,
    pow 8, mean 4, x * r 8, .to(bf16) 6, * the fp32 weight 6, .to(bf16) 6 = 44 bytes and 9 launches, not the
    fused 3 passes (6 bytes); in fp32 the casts are no-ops (28 bytes, 6 launches)."""
    from flashpar.sim import elementwise

    assert elementwise.norm_bytes(2) == 44 and elementwise.norm_bytes(4) == 28
    assert elementwise.norm_kernels(2) == 9 and elementwise.norm_kernels(4) == 6
    w = _w(Layout(1, 1, 1, 1))
    eager = dataclasses.replace(w, flashpar_compiled=False)
    fp = PEERS["flashpar"]
    # the norms' share of the difference: 2 norms x (44 - 6) bytes x 16 per token, 64 tokens
    rope = 64 * ((5 - 3) * 2 * 24 + 2 * 2 * 8)
    assert step.elementwise_bytes(eager, fp) - step.elementwise_bytes(w, fp) == 64 * 2 * (44 - 6) * 16 + rope
    # launches: 2 norms x 9, 2 residual adds, rope_qkv's 9, SwiGLU's 2; compiled the shared figure
    assert elementwise.kernels(eager, fp) == (31, 62)
    assert elementwise.kernels(w, fp) == elementwise.KERNELS_PER_BLOCK == elementwise.kernels(eager, PEERS["torch"])
    hw = w.cluster.device
    fwd, bwd = step.elementwise(eager, fp, hw)
    assert fwd.total == pytest.approx(hw.memory_time(step.elementwise_bytes(eager, fp)) + 31 * hw.gemm_overhead_s)
    assert bwd.total > fwd.total > step.elementwise(w, fp, hw)[0].total


def test_flashpar_eager_extras_of_the_families_by_hand():
    """q/k/v bias (Qwen2) and qk-norm (Qwen3), bf16, the TINY shape: per token the bias add 2 x 2 x 32 (128), qk-norm
    44 x 24 (1056) and the cat of q, k, v 2 x 2 x 32 (128); launches: the bias's cast and add (2), two norms and
    the cat (19)."""
    from flashpar.sim import elementwise

    plain = _w(Layout(1, 1, 1, 1), flashpar_compiled=False)
    qwen2 = _w(Layout(1, 1, 1, 1), dataclasses.replace(TINY, family="qwen2", qkv_bias=True), flashpar_compiled=False)
    qwen3 = _w(Layout(1, 1, 1, 1), dataclasses.replace(TINY, family="qwen3", qk_norm=True), flashpar_compiled=False)
    fp = PEERS["flashpar"]
    assert step.elementwise_bytes(qwen2, fp) - step.elementwise_bytes(plain, fp) == 64 * 128
    assert step.elementwise_bytes(qwen3, fp) - step.elementwise_bytes(plain, fp) == 64 * (1056 + 128)
    assert elementwise.kernels(qwen2, fp)[0] == 31 + 2 and elementwise.kernels(qwen3, fp)[0] == 31 + 19


def test_eager_flashpar_step_is_slower_than_compiled_and_the_options_pick_it():
    """A whole step: flashpar's eager elementwise work costs time; ``Workload.of`` reads ``options.compile``
    (eager where the options have no such field)."""
    import types

    from flashpar.options import ParallelOptions

    w = Workload(load_model("llama3-8b"), Layout(8, 1, 1, 1), H100, ((8192,),))
    eager = dataclasses.replace(w, flashpar_compiled=False)
    assert simulate(eager, PEERS["flashpar"])["step_s"] > simulate(w, PEERS["flashpar"])["step_s"]
    assert simulate(eager, PEERS["torch"])["step_s"] == simulate(w, PEERS["torch"])["step_s"]
    opts = ParallelOptions()
    args = (w.cfg, w.layout, w.cluster, w.packs)
    assert Workload.of(*args, opts).flashpar_compiled is bool(getattr(opts, "compile", False))
    fields = {k: getattr(opts, k) for k in ("dtype_bytes", "checkpoint_activations", "regather", "gather_vocab",
                                            "prefetch", "zero_collective")}
    assert Workload.of(*args, types.SimpleNamespace(**fields, compile=True)).flashpar_compiled is True
    assert Workload.of(*args, types.SimpleNamespace(**fields)).flashpar_compiled is False


def test_a_batch_of_sequences_per_rank():
    one, two = _w(Layout(2, 1, 1, 2)), _w(Layout(2, 1, 1, 2), batch=2)
    assert two.sizes(PEERS["flashpar"])["t_cp"] == 2 * one.sizes(PEERS["flashpar"])["t_cp"] == 128
    r = simulate(two, PEERS["flashpar"])
    assert r["tokens_per_s"] == pytest.approx(2 * 2 * 64 / r["step_s"])
    a1, a2 = step.attention(one, PEERS["flashpar"])[0], step.attention(two, PEERS["flashpar"])[0]
    assert a2[1].total == pytest.approx(2 * a1[1].total)  # each sequence runs its own attention
    with pytest.raises(ValueError, match="batch"):
        _w(Layout(1, 1, 1, 1), batch=0)


def test_torch_async_tp_hides_the_tensor_parallel_transfers_that_dtensor_exposes():
    w = Workload(load_model("llama3-8b"), Layout(1, 1, 1, 8), H100, ((8192,),))
    sync, asyn = simulate(w, PEERS["torch"]), simulate(w, PEERS["torch_async_tp"])
    # one 8K sequence over tp 8: 1,024-row GEMM pieces, so the last piece's transfer stays exposed; the rest hides
    assert asyn["exposed"]["tp"] < 0.25 * sync["exposed"]["tp"]
    assert asyn["no_comm_s"] > sync["no_comm_s"]  # one GEMM piece per peer costs compute
    assert asyn["memory"] == sync["memory"]


def test_the_doubling_collective_by_hand():
    """n = 5: steps at distances 1, 2, 4 carry 1, 2, 1 chunks: 3 latencies and 4 chunks, where gloo's ring pays 4
    latencies for the same 4 chunks; n = 1 moves nothing; n = 2 is one step either way.  On a GPU preset the ring
    is NCCL's collective (``Hardware.collective``)."""
    hw = dataclasses.replace(preset("h100-ib"), collectives="ring")
    lat, per_byte = hw.link_latency_s, 1 / hw.link_bytes_per_s
    c = 1e6
    assert zero.collective_s(zero.DOUBLING, 5, hw, c) == pytest.approx(3 * lat + 4 * c * per_byte)
    assert zero.collective_s(zero.RING, 5, hw, c) == pytest.approx(4 * lat + 4 * c * per_byte)
    assert zero.collective_s(zero.DOUBLING, 1, hw, c) == zero.collective_s(zero.RING, 1, hw, c) == 0.0
    assert zero.collective_s(zero.DOUBLING, 2, hw, c) == zero.collective_s(zero.RING, 2, hw, c)
    nccl = preset("h100-ib")
    assert zero.collective_s(zero.RING, 5, nccl, c) == nccl.collective("all_gather", 5, 5 * c).total_s


def test_auto_moves_units_by_doubling_only_where_nccl_is_slower():
    """llama3-8b on 512 GPUs.  dp 128 x tp 4: the shard group has 2 ranks on each of 64 nodes, and NCCL's rings
    use both ranks' ports (96 GB/s of bus bandwidth) where doubling's steps each wait on one port: auto takes
    NCCL's collective.  dp 64 x tp 8: one rank per node, NCCL runs PAT at 0.75 of one port and 2.8 us a rank,
    where doubling pays 6 network steps at the whole port: auto takes doubling, and the step is faster for it.  The
    baseline and the torch peers ride the backend's collective.  A shard group of 2 (one step either way): ring.
    An explicit choice is kept."""
    cfg = load_model("llama3-8b")
    big = Workload(cfg, Layout(128, 1, 1, 4), H100, ((8192,),), elem_bytes=2)
    assert zero.zero_collective(big, PEERS["flashpar"]) == zero.RING
    wide = Workload(cfg, Layout(64, 1, 1, 8), H100, ((8192,),), elem_bytes=2)
    assert zero.zero_collective(wide, PEERS["flashpar"]) == zero.DOUBLING
    assert zero.zero_collective(wide, PEERS["baseline"]) == zero.RING
    assert zero.zero_collective(wide, PEERS["torch"]) == zero.RING
    small = Workload(cfg, Layout(2, 1, 1, 8), H100, ((8192,),), elem_bytes=2)
    assert zero.zero_collective(small, PEERS["flashpar"]) == zero.RING
    ring = dataclasses.replace(wide, zero_collective="ring")
    assert zero.zero_collective(ring, PEERS["flashpar"]) == zero.RING
    fp = PEERS["flashpar"]
    assert zero.data_parallel(wide, fp).total < zero.data_parallel(ring, fp).total
    with pytest.raises(ValueError, match="zero_collective"):
        dataclasses.replace(wide, zero_collective="tree")


def test_the_expected_slowest_of_n_devices():
    """``z(n)`` against closed forms: z(1) = 0, z(2) = 1 / sqrt(pi), z(3) = 3 / (2 sqrt(pi)); growing with n; the
    step of a synchronous layout is (1 + s z(GPUs)) x its own, the same share for every configuration."""
    from flashpar.sim import sync

    assert sync.expected_max(1) == 0.0
    assert sync.expected_max(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert sync.expected_max(3) == pytest.approx(1.5 / math.sqrt(math.pi), rel=1e-9)
    zs = [sync.expected_max(n) for n in (2, 8, 64, 512)]
    assert zs == sorted(zs) and 3.0 < zs[-1] < 3.1
    w = _w(Layout(2, 1, 1, 2))
    spread = dataclasses.replace(w, cluster=dataclasses.replace(w.cluster, spread=0.03))
    for peer in (PEERS["flashpar"], PEERS["torch"]):
        plain, slow = simulate(w, peer), simulate(spread, peer)
        assert plain["sync_s"] == 0.0
        assert slow["step_s"] == pytest.approx(plain["step_s"] * (1 + 0.03 * sync.expected_max(4)), rel=1e-12)
        assert slow["sync_s"] == pytest.approx(slow["step_s"] - plain["step_s"], rel=1e-9)


def test_the_lanes_share_a_port_only_with_transfers_on_the_same_kind_of_link():
    """dp 2 x cp 4 x tp 2 on nodes of 8: tp and cp on NVLink, the shard group (dp x cp, 8 ranks on 2 nodes) on
    the ports: no block transfer shares the lanes' port.  dp 4 x cp 2 on nodes of 2: cp's K/V and the shard group
    both ride the ports."""
    cfg = load_model("llama3-8b")
    inside = Workload(cfg, Layout(2, 4, 1, 2), H100, ((4096,),))
    assert zero.port_keys(inside, PEERS["flashpar"]) == ()
    across = Workload(cfg, Layout(4, 2, 1, 1), dataclasses.replace(H100, gpus_per_node=1), ((4096,),))
    assert zero.port_keys(across, PEERS["flashpar"]) == ("cp",)
    pieces = zero._Pieces(across, PEERS["flashpar"])
    units = zero._units(across, PEERS["flashpar"], (zero.PREFETCH,) * cfg.layers, pieces)
    kv = pieces.blocks[zero.PREFETCH][0].sent["cp"]
    assert kv > 0 and units[1].port_fwd == pytest.approx(kv)
