"""The parallel Llama on a (dp, cp, tp) mesh against the single-process model: loss and every gradient; the
parameter-layout table against the single-process parameters."""

from __future__ import annotations

import itertools

import pytest
import torch

from dist_harness import run_ranks
from flashpar.models import Llama, LlamaConfig
from flashpar.models.layout import layout_of, mesh_name
from train_workers import check_meshes, vocab_loss_cases

MESH_CASES = [((1, 2, 2), "zero3", True), ((2, 2, 1), "zero3", True), ((2, 1, 2), "zero3", True),
              ((4, 1, 1), "zero3", True), ((1, 4, 1), "zero3", True), ((2, 2, 1), "replicate", True),
              ((2, 1, 2), "replicate", False), ((1, 2, 2), "zero3", False)]


@pytest.fixture(scope="module")
def mesh_results():
    """Every case of ``MESH_CASES`` on 4 ranks, in one spawn: per case, each rank's (errors over TOL, count)."""
    per_rank = run_ranks(4, check_meshes, MESH_CASES)
    return {case: [r[i] for r in per_rank] for i, case in enumerate(MESH_CASES)}


@pytest.mark.parametrize("shape, dp_mode, tie", MESH_CASES)
def test_parallel_model_matches_single_process(mesh_results, shape, dp_mode, tie):
    per_rank = mesh_results[(shape, dp_mode, tie)]
    bad = {r: errs for r, (errs, _) in enumerate(per_rank) if errs}
    # loss, 9 tensors per block, embedding, final norm (and the head when untied)
    assert per_rank[0][1] == 1 + 9 * 2 + 2 + (not tie) and not bad, bad


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


def test_vocabulary_parallel_loss_matches_float64_cross_entropy_at_tp_1_to_4():
    """Loss (summed over the tp ranks) and each rank's logit gradient against ``F.cross_entropy`` of the full
    float64 logits.  The loss computes in fp32 (``logits.float()``): ~1e-7 relative over 12 vocabulary
    columns and 10 rows, so 1e-5; a sum not all-reduced (forward or backward) is an O(1) error.  No
    FutureWarning: the all-reduces are ``flashpar.models.vocab``'s own autograd function."""
    per_rank = run_ranks(4, vocab_loss_cases)
    assert [tp for tp, *_ in per_rank[0]] == [1, 2, 3, 4] and [len(r) for r in per_rank] == [4, 3, 2, 1]
    for rank, cases in enumerate(per_rank):
        for tp, loss_err, grad_err, future in cases:
            assert loss_err < 1e-5 and grad_err < 1e-5 and not future, (rank, tp, loss_err, grad_err, future)
