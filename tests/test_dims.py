"""``ParallelDims``: the mesh's sizes, the rules between them and a model, and the numbering of its ranks; how
Ulysses splits the heads (``head_layout``)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from flashpar.dims import DIMS, ParallelDims, head_layout
from flashpar.models import LlamaConfig


@pytest.mark.parametrize(("kw", "needle"), [
    ({"dp": 0}, "dp must be an integer >= 1, got 0"),
    ({"tp": 1.5}, "tp must be an integer >= 1, got 1.5"),
    ({"cp": True}, "cp must be an integer >= 1, got True"),
])
def test_sizes_must_be_positive_integers(kw, needle):
    with pytest.raises(ValueError, match=needle):
        ParallelDims(**kw)


@pytest.mark.parametrize(("dims", "model", "mode", "needle"), [
    (ParallelDims(ulysses=2, tp=2), None, None, "ulysses = 2 and tp = 2 both > 1 is not supported"),
    (ParallelDims(ulysses=2), None, "ring", "mode ring does not apply to the Ulysses all-to-alls"),
    (ParallelDims(tp=2), LlamaConfig(heads=6, kv_heads=3, hidden=96), None, "kv heads = 3 is not divisible by tp = 2"),
    (ParallelDims(tp=2), LlamaConfig(ffn=75), None, "FFN size = 75 is not divisible by tp = 2"),
    (ParallelDims(ulysses=3), LlamaConfig(), None, "ulysses = 3: heads = 4 is not divisible"),
    (ParallelDims(ulysses=2, tp=2), LlamaConfig(ffn=75), "ring", "both > 1"),  # (the dims' own rule first)
])
def test_each_rule_is_one_line_naming_the_sizes(dims, model, mode, needle):
    bad = dims.problem(model, mode)
    assert bad is not None and needle in bad and "\n" not in bad, bad
    with pytest.raises(ValueError, match="^ParallelLlama: "):
        dims.check(model, mode, where="ParallelLlama: ")


@pytest.mark.parametrize(("heads", "kv_heads", "n", "per_rank"), [
    (4, 4, 1, (4, 4)), (4, 4, 2, (2, 2)), (8, 2, 4, (2, 1)),  # MHA; GQA with kv_heads >= n
    (4, 2, 4, (1, 1)), (6, 1, 3, (2, 1)), (3, 1, 3, (1, 1)),  # fewer kv heads than ranks: each replicated
])
def test_head_layout_gives_each_ulysses_rank_its_heads(heads, kv_heads, n, per_rank):
    assert head_layout(heads, kv_heads, n) == per_rank


@pytest.mark.parametrize(("heads", "kv_heads", "n", "needle"), [
    (4, 3, 2, "heads = 4 must be a positive multiple of kv_heads = 3"),
    (5, 1, 2, "heads = 5 is not divisible by the sequence-parallel size 2"),
    (12, 6, 4, "kv_heads = 6 is not divisible by the sequence-parallel size 4"),
    (12, 3, 4, "kv_heads = 3 < 4 ranks must divide 4"),
])
def test_head_layout_refuses_what_ulysses_cannot_split(heads, kv_heads, n, needle):
    with pytest.raises(ValueError, match=needle):
        head_layout(heads, kv_heads, n)


def test_valid_dims_have_no_problem_and_their_sizes():
    dims = ParallelDims(dp=2, cp=3, ulysses=1, tp=2)
    assert dims.problem(LlamaConfig(), "flash") is None and dims.seq_problem(12) is None
    assert "at least 12 tokens" in dims.seq_problem(11)
    assert (dims.world_size, dims.shard_size, dims.seq_ranks) == (12, 6, 6)
    assert ParallelDims(ulysses=4, cp=2).seq_problem(15) is not None


def test_strides_number_the_ranks_tp_innermost():
    """Rank ``((d cp + c) U + u) tp + t``: each dim's coordinate is ``rank // stride % size``, every rank once."""
    dims = ParallelDims(dp=2, cp=3, ulysses=2, tp=1)
    seen = set()
    for d, c, u, t in itertools.product(range(2), range(3), range(2), range(1)):
        rank = ((d * 3 + c) * 2 + u) * 1 + t
        coords = tuple(rank // dims.stride(name) % getattr(dims, name) for name in DIMS)
        assert coords == (d, c, u, t)
        seen.add(rank)
    assert seen == set(range(dims.world_size))
    with pytest.raises(ValueError, match="unknown mesh dim 'pp'"):
        dims.stride("pp")


class _Mesh:
    """The part of a device mesh ``of_mesh`` reads: its dim names and each dim's size."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.mesh_dim_names, self._sizes = tuple(sizes), sizes

    def __getitem__(self, name):
        size = self._sizes[name]
        return type("Dim", (), {"size": lambda self: size})()


def test_of_mesh_reads_the_sizes_and_a_mesh_without_ulysses_has_one():
    assert ParallelDims.of_mesh(_Mesh({"dp": 2, "cp": 1, "ulysses": 2, "tp": 1})) == ParallelDims(2, 1, 2, 1)
    assert ParallelDims.of_mesh(_Mesh({"dp": 1, "cp": 2, "tp": 2})) == ParallelDims(1, 2, 1, 2)


@pytest.mark.parametrize("nodes, per_node, mesh, spans", [
    # 2 nodes x 2 ranks: tp inside a node, cp across
    (2, 2, (1, 2, 1, 2), {"dp": 1, "cp": 2, "ulysses": 1, "tp": 1}),
    # 2 nodes x 4 ranks: tp 2 and cp 2 inside a node, dp across
    (2, 4, (2, 2, 1, 2), {"dp": 2, "cp": 1, "ulysses": 1, "tp": 1}),
    # 4 nodes x 2 ranks: Ulysses 2 inside each node, cp 4 across four nodes
    (4, 2, (1, 4, 2, 1), {"dp": 1, "cp": 4, "ulysses": 1, "tp": 1}),
])
def test_node_placement_keeps_tp_and_ulysses_inside_a_node(nodes, per_node, mesh, spans):
    """torchrun places ranks ``n L .. (n + 1) L - 1`` on node ``n``; the row-major mesh puts tp (and ulysses)
    groups on neighbouring ranks: each dim's groups span the nodes listed, and nothing is refused."""
    dims = ParallelDims(*mesh)
    assert dims.world_size == nodes * per_node
    assert dims.nodes_spanned(per_node) == spans
    assert dims.node_problem(per_node) is None


def test_tp_across_nodes_is_one_line_unless_allowed(monkeypatch, tmp_path):
    """tp 4 on nodes of 2 ranks, or tp 2 on nodes of 3 (a group straddles two nodes): one line naming the dims, the
    ranks per node and the way out; ``ready`` refuses it before any process starts, and runs it with
    ``--allow-cross-node-tp``; one node holds any mesh."""
    line = ParallelDims(1, 1, 1, 4).node_problem(2)
    assert line.startswith("tp would span nodes: 2 ranks per node (LOCAL_WORLD_SIZE) and ulysses x tp = 4")
    assert "--allow-cross-node-tp" in line and "\n" not in line
    assert ParallelDims(1, 3, 1, 2).nodes_spanned(3)["tp"] == 2  # ranks 2, 3 on nodes 0 and 1
    assert ParallelDims(1, 2, 2, 1).node_problem(1).startswith("ulysses would span nodes")
    assert ParallelDims(1, 1, 1, 4).node_problem(4) is None
    from flashpar.train.config import TrainConfig, ready

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = TrainConfig(nproc=4, dp=1, cp=1, tp=4, out=str(tmp_path), steps=1, seq_len=256, max_docs=40, workers=0,
                         model=LlamaConfig(hidden=32, layers=1, heads=4, kv_heads=4, ffn=64))
    with pytest.raises(ValueError, match="^tp would span nodes"):
        ready(config, 4)
    assert ready(dataclasses.replace(config, allow_cross_node_tp=True), 4).tp == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")  # torchrun's variable read as the job's figures read it
    with pytest.raises(ValueError, match="^LOCAL_WORLD_SIZE='two' is not an integer$"):
        ready(config, 4)
