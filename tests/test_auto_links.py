"""One decision, two users: ``mode="auto"`` at run time picks on the figures the simulator times.

* The simulator's linears (``flashpar.sim.step.linear_calls``) are the calls the runtime's ops make: a spy on
  ``pick_mode`` during one training step at tp 2 records the same ops, shapes and options.
* A process group's figures (``flashpar.links.group_hardware_of``: its global ranks, torchrun's
  ``LOCAL_WORLD_SIZE``) are ``flashpar.cost.group_hardware``'s: tp inside a node on NVLink, dp across.
* For every flashpar layout of the README's cluster table (``docs/benchmarks/simulate-table.json``), on every cp
  rank's rows, the runtime's picks (``pick_mode`` through ``flashpar.links``, the groups' ranks those of the
  mesh) equal the simulator's; the planner's cp figures (``train.planning.group_figures``) are the cp group's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from dist_harness import run_ranks
from flashpar import links
from flashpar.cost import preset
from flashpar.overlap.call import pick_mode
from flashpar.sim import step
from flashpar.sim.model_configs import load_model
from flashpar.sim.peers import PEERS
from flashpar.sim.topology import Cluster, Layout
from flashpar.sim.workload import Workload
from links_workers import group_links, recorded_picks, sharded_pick_rows
from train_workers import CFG, sequences

TABLE = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "simulate-table.json"
AUTO = dataclasses.replace(PEERS["flashpar"], mode="auto")


@pytest.mark.parametrize("shape", [(1, 1, 1, 2), (1, 1, 2, 1)], ids=["tp2", "ulysses2"])
def test_the_simulators_linears_are_the_calls_the_runtime_makes(shape):
    """tp 2 or Ulysses 2, one sequence of 107 tokens, fp32: q/k/v, o, gate/up and down as the model calls them
    (the head's all-gather + GEMM besides); each call's options as the simulator passes them to
    ``choose_modes`` (the all-to-all ops pass ``prepare``'s defaults: they pick both ways at once)."""
    got = run_ranks(2, recorded_picks, shape)
    assert got[0] == got[1]
    lens = sequences(1)[0][2]
    w = Workload(CFG, Layout(*shape), Cluster(preset("cpu"), preset("cpu")), (tuple(lens),), elem_bytes=4)
    a2a = ("matmul_a2a", "a2a_matmul")
    sim = {(c.op, c.n, c.rows, c.n_in, c.n_out, True, *((True, False) if c.op in a2a else (c.regather, c.split)),
            (0, 1)) for c in step.linear_calls(w, AUTO) if c.n > 1}
    runtime = {tuple(r) for r in got[0]}
    head = {r for r in runtime if r[4] == CFG.vocab_size // 2}
    assert len(sim) == (4 if shape[3] == 2 else 2) and runtime - head == sim, (runtime, sim)


def test_a_fused_zero3_linear_picks_on_the_same_rows_on_every_rank_of_its_shard_group():
    """cp 2 (flashcp keeps the 107 tokens' documents whole: the two cp ranks hold different counts), every block
    fused, mode auto, calls unchecked: each rank would pick the shard group's schedule on its own tokens and the
    two could differ; both pick on the sequence's tokens over cp (107 // 2), as the simulator does."""
    got = run_ranks(2, sharded_pick_rows, (1, 2, 1, 1))
    assert got[0] == got[1] == [sum(sequences(1)[0][2]) // 2], got


def test_a_process_groups_figures_follow_its_nodes():
    """dp 2 x tp 2 as two nodes of 2 (``LOCAL_WORLD_SIZE`` 2): every tp group on one node, every dp group on two;
    all four on one node (``LOCAL_WORLD_SIZE`` 4)."""
    two = run_ranks(4, group_links, 2)
    assert all(r["tp"][0] == 1 and r["dp"][0] == 2 for r in two)
    one = run_ranks(4, group_links, 4)
    assert all(r["tp"][0] == 1 and r["dp"][0] == 1 for r in one)


def _table_layouts() -> list[tuple[str, int, int, Layout]]:
    rows = json.loads(TABLE.read_text())["rows"]
    out = []
    for r in rows:
        best = r["flashpar_best"]
        if best is not None:
            out.append((r["model"], r["gpus"], r["seq"], Layout(best["dp"], best["cp"], best["ulysses"], best["tp"])))
    return out


@pytest.fixture
def on_a_cluster(monkeypatch):
    """``flashpar.links`` as on the table's cluster: h100-96gb devices, 8 per node, h100-ib between nodes, the
    groups' ranks given by the test (``ranks``)."""
    ranks: dict = {}
    monkeypatch.setattr(links, "device_hardware", lambda device_type: preset("h100-96gb"))
    monkeypatch.setattr(links, "inter_hardware", lambda device_type: preset("h100-ib"))
    monkeypatch.setattr(links, "ranks_per_node", lambda: 8)
    monkeypatch.setattr(links, "spans_nodes", lambda: True)
    monkeypatch.setattr(links, "_ranks", lambda group: ranks[group])
    return ranks


def test_runtime_picks_equal_the_simulators_on_every_layout_of_the_table(on_a_cluster):
    from flashpar.cp.lengths import resolve_lengths
    from flashpar.train import planning

    layouts = _table_layouts()
    assert len(layouts) == 12
    cluster = Cluster(preset("h100-96gb"), preset("h100-ib"), 8, "h100-96gb", "h100-ib")
    x = torch.empty(0, dtype=torch.bfloat16)
    checked = 0
    for model, _gpus, seq, layout in layouts:
        cfg = load_model(model)
        packs = tuple(tuple(p) for p in resolve_lengths("wlbllm").packs(seq, 1))
        w = Workload(cfg, layout, cluster, packs, elem_bytes=2)
        groups = w.groups(AUTO)
        scales = [scale for scale, _, _ in step.attention(w, AUTO)]
        for r, scale in enumerate(scales[: layout.cp]):
            group = f"tp of cp rank {r}"
            on_a_cluster[group] = tuple(layout.group_ranks(("tp",), rank=r * layout.stride("cp")))
            hw = links.group_hardware_of(group, "cuda")
            assert hw == groups["tp"][1] or layout.tp == 1
            for c in step.linear_calls(w, AUTO, rows=scale * w.sizes(AUTO)["t_u"]):
                if c.n == 1:
                    continue
                if c.op in ("matmul_a2a", "a2a_matmul"):  # the Ulysses group's; its ops pick both ways at once
                    group = f"ulysses of cp rank {r}"
                    on_a_cluster[group] = tuple(layout.group_ranks(("ulysses",), rank=r * layout.stride("cp")))
                    assert links.group_hardware_of(group, "cuda") == groups["ulysses"][1]
                    runtime = pick_mode("auto", None, c.n, c.op, c.rows, c.n_in, c.n_out, x, merged=True, group=group)
                else:
                    runtime = pick_mode("auto", None, c.n, c.op, c.rows, c.n_in, c.n_out, x, merged=True,
                                        regather=c.regather, split=c.split, group=group)
                assert runtime == c.picks(), (model, seq, layout.label(), r, c)
                checked += 1
        cp_hw = planning.group_figures(preset("h100-96gb"), layout, ("cp",), "cuda")
        assert cp_hw == groups["cp"][1] or layout.cp == 1, (model, seq, layout.label())
    assert checked > 0
