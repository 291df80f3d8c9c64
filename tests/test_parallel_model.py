"""The parallel Llama on a (dp, cp, ulysses, tp) mesh against the single-process model: loss and every gradient,
checkpoints across meshes; the parameter-layout table against the single-process parameters."""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_harness import SpawnCache
from flashpar.models import Llama, LlamaConfig
from flashpar.models.layout import layout_of, mesh_name
from flashpar.models.parallel import ulysses_qkv_rows
from train_workers import (
    check_meshes,
    checkpoint_across_meshes,
    decay_step,
    gathered_vocab_cases,
    optim_meshes,
    vocab_loss_cases,
)

# (dp, cp, ulysses, tp), dp mode, model (train_workers.MODELS)[, strategy, mode, regather, zero_schedule,
# prefetch, zero_collective, attention_backend] -> world size
MESH_CASES = {
    4: [((1, 2, 1, 2), "zero3", "base"), ((2, 2, 1, 1), "zero3", "base"), ((2, 1, 1, 2), "zero3", "base"),
        ((4, 1, 1, 1), "zero3", "base"), ((1, 4, 1, 1), "zero3", "base"), ((2, 2, 1, 1), "replicate", "base"),
        ((2, 1, 1, 2), "replicate", "untied"), ((1, 2, 1, 2), "zero3", "untied"),
        # Ulysses inside cp; with ZeRO-3 over dp (MLP rows, attention whole); 2 kv heads replicated on 4 ranks
        ((1, 2, 2, 1), "zero3", "base"), ((2, 1, 2, 1), "zero3", "base"), ((2, 1, 2, 1), "replicate", "untied"),
        ((1, 1, 4, 1), "zero3", "base"), ((1, 1, 4, 1), "zero3", "untied"),
        # --regather: the column-parallel linears and the head gather their input again in backward
        ((1, 2, 1, 2), "replicate", "untied", "flashcp", "flash", True),
        # the context-parallel attention on its explicit-matrix kernels (ParallelOptions.attention_backend)
        ((1, 2, 1, 2), "zero3", "base", "per_doc", "flash", False, "prefetch", 1, "ring", "math"),
        # small vocabularies: the embedding / head weight gathered over tp (flashpar.models.vocab.gathers_weight)
        ((1, 2, 1, 2), "zero3", "vocab16"), ((2, 1, 1, 2), "zero3", "vocab16-untied"),
        ((1, 1, 1, 4), "replicate", "vocab16-untied"), ((1, 2, 1, 2), "zero3", "vocab54", "per_doc", "none"),
        # ZeRO-3's schedules over the shard group (dp x cp x ulysses): fused, one per block, two blocks ahead
        ((2, 1, 1, 2), "zero3", "base", "flashcp", "flash", False, "fused"),
        ((1, 2, 1, 2), "zero3", "untied", "flashcp", "flash", False, ("fused", "prefetch")),
        ((2, 2, 1, 1), "zero3", "untied", "flashcp", "flash", False, "prefetch", 2),
        ((1, 4, 1, 1), "zero3", "base", "per_doc", "none", False, ("prefetch", "fused")),
        # the units moved by the doubling steps (flashpar.overlap.doubling) over a shard group of 4, and of 3
        ((4, 1, 1, 1), "zero3", "untied", "flashcp", "flash", False, "prefetch", 1, "doubling")],
    3: [((1, 1, 3, 1), "zero3", "heads6"), ((1, 1, 3, 1), "zero3", "heads6-mqa"),
        ((1, 1, 1, 3), "zero3", "heads6-vocab12"),
        ((1, 3, 1, 1), "zero3", "untied", "flashcp", "flash", False, "fused"),
        ((3, 1, 1, 1), "zero3", "base", "flashcp", "flash", False, "prefetch", 2, "doubling")],
    2: [((1, 1, 2, 1), "zero3", "base"), ((1, 1, 2, 1), "replicate", "untied")],
}
CASE_IDS = [(n, case) for n, cases in MESH_CASES.items() for case in cases]
# gradient accumulation and clipping by the global norm: (dp, cp, ulysses, tp), dp mode, model, micro-batches,
# clip ratio (the gradients clipped to that x their norm; 2.0: the coefficient clamps to 1, no clipping)
OPTIM_CASES = {
    1: [((1, 1, 1, 1), "zero3", "base", 2, 0.5), ((1, 1, 1, 1), "zero3", "untied", 3, 2.0)],
    2: [((2, 1, 1, 1), "zero3", "base", 2, 0.5), ((1, 1, 2, 1), "zero3", "base", 2, 0.5)],
    3: [((3, 1, 1, 1), "zero3", "base", 2, 0.5), ((1, 3, 1, 1), "zero3", "base", 2, 0.5),
        ((1, 1, 3, 1), "zero3", "heads6", 2, 0.5)],
    4: [((1, 2, 1, 2), "zero3", "base", 2, 0.5), ((2, 2, 1, 1), "zero3", "base", 2, 0.5),
        ((2, 1, 1, 2), "replicate", "untied", 2, 0.5), ((2, 1, 2, 1), "zero3", "base", 3, 0.5)],
}
OPTIM_IDS = [(n, case) for n, cases in OPTIM_CASES.items() for case in cases]
# saved on a Ulysses mesh after one step, loaded on a tp mesh, a ZeRO-3 + Ulysses mesh and the same mesh
CHECKPOINT_MESHES = ((1, 2, 2, 1), [(1, 2, 1, 2), (2, 1, 2, 1), (1, 2, 2, 1)])


def _calls(n: int) -> list[tuple]:
    calls = [("meshes", check_meshes, MESH_CASES[n])] if n in MESH_CASES else []
    calls += [("optim", optim_meshes, OPTIM_CASES[n])]
    # the vocabulary cases last: their groups of 1..4 ranks leave the ranks with different numbers of groups,
    # and torch names a later point-to-point twin group (flashpar.dist.p2p_group) by that number
    return calls + [("checkpoint", checkpoint_across_meshes, *CHECKPOINT_MESHES), ("decay", decay_step, (1, 2, 1, 2)),
                    ("vocab", vocab_loss_cases), ("gathered", gathered_vocab_cases)] if n == 4 else calls


@pytest.fixture(scope="module")
def spawned():
    return SpawnCache(_calls, timeout=600.0)  # one spawn per world size for every test below


@pytest.mark.parametrize("n, case", CASE_IDS, ids=[f"{n}-{c}" for n, c in CASE_IDS])
def test_parallel_model_matches_single_process(spawned, n, case):
    """``one_step``'s loss and every gradient within ``flashpar.train.check.TOL`` (1e-4: fp32, the mesh only
    reorders sums, measured <= 6e-7; a gradient not summed over the ulysses ranks, or a kv head read from the
    wrong group, is O(1))."""
    per_rank = [out[MESH_CASES[n].index(case)] for out in spawned(n)["meshes"]]
    bad = {r: errs for r, (errs, _) in enumerate(per_rank) if errs}
    # loss, 9 tensors per block, embedding, final norm (and the head when untied)
    assert per_rank[0][1] == 1 + 9 * 2 + 2 + ("untied" in case[2]) and not bad, bad


@pytest.mark.parametrize("n, case", OPTIM_IDS, ids=[f"{n}-{c}" for n, c in OPTIM_IDS])
def test_accumulated_and_clipped_gradients_match_single_process(spawned, n, case):
    """M micro-batches per dp rank (gradients accumulated, summed over copies once; ZeRO-3 rows reduce-scattered
    in every backward) and clipping by the global norm against the single-process model on all M x dp
    sequences: the loss, the global norm (each shard counted once, against the float64 norm of the full
    gradients) and every gradient after ``clip_grad_norm_``, within ``TOL`` (1e-4: fp32 reordered sums,
    measured <= 1e-6).  A norm counted on every copy is off by sqrt(copies), sums posted for every
    micro-batch double the gradients: O(1) errors."""
    per_rank = [out[OPTIM_CASES[n].index(case)] for out in spawned(n)["optim"]]
    bad = {r: errs for r, (errs, *_) in enumerate(per_rank) if errs}
    # loss, norm, 9 tensors per block, embedding, final norm (and the head when untied)
    assert per_rank[0][1] == 2 + 9 * 2 + 2 + (case[2] == "untied") and not bad, bad
    assert all(norm_err <= 1e-5 for _, _, norm_err, _ in per_rank), per_rank  # fp32 norms summed in float64


def test_checkpoint_of_a_ulysses_mesh_loads_on_other_meshes(spawned):
    """DCP save after one AdamW step on (dp, cp, ulysses, tp) = (1, 2, 2, 1), load on each mesh of
    ``CHECKPOINT_MESHES``: the loaded model's full weights and moments (``to_full``) equal the saved ones
    exactly (pure copies and indexing), and its next loss equals the saved model's within fp32 reordering."""
    for rank, cases in enumerate(spawned(4)["checkpoint"]):
        assert [shape for shape, *_ in cases] == CHECKPOINT_MESHES[1], cases
        for shape, differ, loss_saved, loss_loaded in cases:
            assert differ == 0.0, (rank, shape, differ)
            # 1e-5: the same weights on another mesh only reorder fp32 sums (measured ~1e-7)
            assert loss_loaded == pytest.approx(loss_saved, rel=1e-5), (rank, shape)


def test_adamw_decays_the_matrices_and_not_the_norm_gains(spawned):
    """``build``'s AdamW on (1, 2, 1, 2), one step on zero gradients: Adam's term is then 0, so each parameter
    moves by the decoupled decay alone, ``p <- p (1 - lr wd)`` on the matrices (to fp32 rounding of the
    product, 1e-7 of weights ~1) and not at all on the norm gains."""
    for rank, moved in enumerate(spawned(4)["decay"]):
        assert {n.split(".")[-2] for n, (d, _, _) in moved.items() if not d} == {"attn_norm", "mlp_norm", "norm"}
        for name, (decayed, off, change) in moved.items():
            assert (off <= 1e-7 and change > 0) if decayed else change == 0.0, (rank, name, off, change)


def test_ulysses_qkv_rows_take_each_head_groups_rows():
    """Head group g holds q heads [g H/U, (g+1) H/U) and its kv head(s): every q row once, every kv row in
    U / H_kv groups when H_kv < U (replicated), once when H_kv >= U."""
    for heads, kv_heads, n in [(4, 2, 2), (4, 2, 4), (6, 3, 3), (6, 1, 3), (8, 8, 4)]:
        cfg = LlamaConfig(hidden=8 * heads, heads=heads, kv_heads=kv_heads)
        d, hq, hk = cfg.head_dim, heads // n, max(kv_heads // n, 1)
        rows = ulysses_qkv_rows(cfg, n)
        per_group = (hq + 2 * hk) * d
        assert len(rows) == n * per_group
        for g in range(n):
            mine = rows[g * per_group : (g + 1) * per_group]
            assert mine[: hq * d] == list(range(g * hq * d, (g + 1) * hq * d))
            kv = (g * hk if kv_heads >= n else g * kv_heads // n) * d
            assert mine[hq * d : (hq + hk) * d] == list(range(heads * d + kv, heads * d + kv + hk * d))
            assert mine[(hq + hk) * d :] == [r + kv_heads * d for r in mine[hq * d : (hq + hk) * d]]
        counts = torch.bincount(torch.tensor(rows), minlength=(heads + 2 * kv_heads) * d)
        assert (counts[: heads * d] == 1).all() and (counts[heads * d :] == max(n // kv_heads, 1)).all()


def _unshard_everywhere(layout, shards, cfg, n):
    """``layout.unshard`` as the tp group runs it, in one process: each gather concatenates every rank's piece."""
    pieces: list[list] = [[] for _ in range(n)]
    for t in range(n):
        layout.unshard(shards[t], lambda x, d, t=t: pieces[t].append(x) or x, cfg, n)
    calls = itertools.count()

    def gather(x, dim):
        i = next(calls)
        return torch.cat([pieces[t][i] for t in range(n)], dim=dim)

    return layout.unshard(shards[0], gather, cfg, n)


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_layout_table_shards_tile_every_parameter_and_unshard_inverts(tp):
    """Every single-process parameter belongs to one mesh parameter of ``LAYOUT``; the tp ranks' shards hold
    each element of a sharded parameter once (a replicated one: whole), and ``unshard`` gives back the full
    tensors exactly (pure indexing)."""
    cfg = LlamaConfig(vocab_size=240, hidden=96, heads=12, kv_heads=12, ffn=36, layers=2, tie_embeddings=False)
    full = {n: p.detach() for n, p in Llama(cfg).named_parameters()}
    mesh_names = {mesh_name(n) for n in full}
    assert len(mesh_names) == 2 * 6 + 3  # per block attn_norm, qkv, o_proj, mlp_norm, gate_up, down; embed, norm, head
    covered = []
    for name in sorted(mesh_names):
        layout, names = layout_of(name)
        covered += names
        shards = [layout.shard([full[n] for n in names], t, tp) for t in range(tp)]
        whole = sum(full[n].numel() for n in names)
        assert sum(s.numel() for s in shards) == (whole if layout.tp_dim is not None else tp * whole), name
        for n, got in zip(names, _unshard_everywhere(layout, shards, cfg, tp), strict=True):
            assert torch.equal(got, full[n]), n
    assert sorted(covered) == sorted(full)
    with pytest.raises(KeyError, match="'lm_head' is not in flashpar.models.layout.LAYOUT"):
        layout_of("lm_head.weight")


def test_vocabulary_parallel_loss_matches_float64_cross_entropy_at_tp_1_to_4(spawned):
    """Loss (summed over the tp ranks) and each rank's logit gradient against ``F.cross_entropy`` of the full
    float64 logits.  The loss computes in fp32 (``logits.float()``): ~1e-7 relative over 12 vocabulary
    columns and 10 rows, so 1e-5; a sum not all-reduced (forward or backward) is an O(1) error.  No
    FutureWarning: the all-reduces are ``flashpar.models.vocab``'s own autograd function."""
    per_rank = spawned(4)["vocab"]
    assert [tp for tp, *_ in per_rank[0]] == [1, 2, 3, 4] and [len(r) for r in per_rank] == [4, 3, 2, 1]
    for rank, cases in enumerate(per_rank):
        for tp, loss_err, grad_err, future in cases:
            assert loss_err < 1e-5 and grad_err < 1e-5 and not future, (rank, tp, loss_err, grad_err, future)


def test_gathered_vocabulary_weight_matches_float64_at_tp_1_to_4(spawned):
    """The small-vocabulary path: the tied weight gathered once (``all_gather_rows``), each rank's rows looked up,
    projected and scored against the whole vocabulary (``own_rows_loss``); the loss summed over the tp ranks,
    each rank's gradient of its vocabulary rows (the gather's reduce-scatter) and the projection's gradient
    summed over the ranks, against the full float64 computation in one process.  The loss computes in fp32
    (``logits.float()``), as the activation path's: ~1e-7 relative here, so 1e-5; a gradient not summed over
    the ranks (the reduce-scatter dropped) or the wrong rows is O(1)."""
    per_rank = spawned(4)["gathered"]
    assert [tp for tp, *_ in per_rank[0]] == [1, 2, 3, 4] and [len(r) for r in per_rank] == [4, 3, 2, 1]
    for rank, cases in enumerate(per_rank):
        for tp, loss_err, embed_err, proj_err in cases:
            assert loss_err < 1e-5 and embed_err < 1e-5 and proj_err < 1e-5, (rank, tp, loss_err, embed_err, proj_err)


def test_small_vocabulary_cases_take_the_gathered_path():
    """The mesh cases above meet ``gathers_weight`` as their comments say (else they would test the activation
    path twice): vocabulary 16 and 12 below every cp rank's tokens; 54 between the two cp ranks' counts of the
    per_doc case, so one tp group gathers the weight and the other moves the activations."""
    from flashpar import cp
    from flashpar.models.vocab import gathers_weight
    from train_workers import MODELS, sequences

    for shape, _, model, *rest in [c for cases in MESH_CASES.values() for c in cases if "vocab" in c[2]]:
        vocab, cpn, tp = MODELS[model].vocab_size, shape[1], shape[3]
        for _, _, doc_lens in sequences(shape[0], vocab=vocab):
            plan = cp.plan(doc_lens, cpn, strategy=rest[0] if rest else "flashcp")
            paths = {gathers_weight(vocab, len(plan.local_indices(r)), tp) for r in range(cpn)}
            assert paths == ({True, False} if vocab == 54 else {True}), (shape, model, paths)
    assert not gathers_weight(16, 100, 1) and not gathers_weight(100, 100, 2) and gathers_weight(99, 100, 2)
