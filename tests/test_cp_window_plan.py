"""Planning for sliding windows: ``cp.plan(..., window=W)`` counts a query's pairs as ``min(p + 1, W)`` and a rank's
K/V as what its windows reach, in its figures and stats, and flashcp balances that work."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flashpar.cp import STRATEGIES, CostModel, plan
from flashpar.cp import window as band
from flashpar.cp.cp_plan import CPPlan
from flashpar.cp.lengths import resolve_lengths

LENS = [90, 3, 5, 1, 40, 2, 7, 12, 157, 1, 30]


def test_windowed_pairs_closed_form_matches_the_sum():
    for w in (None, 1, 2, 7, 50):
        for x in range(0, 12):
            for y in range(x, 70, 7):
                assert band.pairs(x, y, w) == sum(p + 1 if w is None else min(p + 1, w) for p in range(x, y))
    xs, ys = np.array([0, 3, 10]), np.array([5, 40, 11])
    assert band.pairs(xs, ys, 7).tolist() == [band.pairs(int(a), int(b), 7) for a, b in zip(xs, ys, strict=True)]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("w", [1, 6, 33, 157])
def test_stats_count_windowed_pairs_and_kv(strategy, n, w):
    p = plan(LENS, n, strategy=strategy, window=w)
    stats = p.stats()
    starts = np.cumsum([0, *LENS[:-1]])
    direct = []
    for r in range(n):
        pos = np.concatenate([np.arange(a, b) - starts[np.searchsorted(starts, a, side="right") - 1]
                              for a, b in p.segments[r]] or [np.zeros(0, dtype=np.int64)])
        direct.append(int(np.minimum(pos + 1, w).sum()))
    kv = p.cost.kv_bytes_per_token
    assert stats["attn_pairs"] == direct
    assert stats["kv_recv_bytes"] == [t * kv for t in band.recv_tokens(p, w)]  # the figures' closed form
    assert stats["kv_send_bytes"] == [t * kv for t in band.send_tokens(p, w)]
    assert sum(stats["kv_send_bytes"]) == sum(stats["kv_recv_bytes"])


def test_window_over_every_document_counts_as_full_causal():
    for strategy in ("flashcp", "per_doc_aware", "whole_doc"):
        full, wide = plan(LENS, 4, strategy=strategy), plan(LENS, 4, strategy=strategy, window=max(LENS))
        assert wide.segments == full.segments
        a, b = full.stats(), wide.stats()
        for key in ("attn_pairs", "kv_recv_bytes", "kv_send_bytes", "est_step_time"):
            assert a[key] == b[key], key


def test_plan_keeps_its_window_through_json_and_refuses_a_bad_one():
    p = plan(LENS, 3, window=16)
    assert p.cost.window == 16 and CPPlan.from_json(p.to_json()) == p
    assert plan(LENS, 3, cost=CostModel(window=16)).cost.window == 16
    for bad in (0, -3, 2.0, True, "16"):
        with pytest.raises(ValueError, match="window must be a positive int or None") as err:
            plan(LENS, 3, window=bad)
        assert "\n" not in str(err.value)


def test_flashcp_plans_for_the_windowed_work():
    """On wlbllm 128K packs over 8 ranks with W = 4096, flashcp planned for the window estimates a step no longer
    than (within 1%, per pack; shorter in all) the plan made without it, both scored under the window; it never
    sends more K/V for the windowed layer."""
    ahead = total_w = total_f = 0.0
    for lens in resolve_lengths("wlbllm").packs(131072, 4, seed=0):
        windowed = plan(lens, 8, window=4096)
        blind = dataclasses.replace(plan(lens, 8), cost=windowed.cost)  # scored under the window
        w, f = windowed.stats()["est_step_time"], blind.stats()["est_step_time"]
        assert w <= 1.01 * f
        total_w, total_f = total_w + w, total_f + f
        ahead += sum(blind.stats()["kv_send_bytes"]) - sum(windowed.stats()["kv_send_bytes"])
    assert total_w < total_f and ahead >= 0


def test_a_model_with_one_window_on_every_layer_is_planned_for_it():
    """Mistral's single window: the trainer's cost model plans for it; a full layer beside windowed ones (Qwen's
    max_window_layers) or no window: the whole-document plan."""
    from flashpar.cp.cost import cost_model_of
    from flashpar.models import LlamaConfig

    mistral = LlamaConfig(family="mistral", windows=(5, 5), max_positions=64)
    mixed = LlamaConfig(family="qwen2", qkv_bias=True, windows=(0, 5), max_positions=64)
    assert cost_model_of(mistral, 4).per_step().window == 5
    assert cost_model_of(mixed, 4).window is None and cost_model_of(LlamaConfig(), 4).window is None


def test_simulate_cp_reports_the_windows_kv_beside_the_full_exchange(tmp_path, capsys):
    """``flashpar simulate cp --window``: plans made for the window; each row's windowed K/V at most the same
    plans' K/V without it, and flashcp's at most half on wlbllm 128K over 8 ranks with W = 4096."""
    import json

    from flashpar.cli import main

    out = tmp_path / "sim.json"
    assert main(["simulate", "cp", "--grid", "8:128K", "--lengths", "wlbllm", "--packs", "2", "--window", "4096",
                 "--strategies", "flashcp,per_doc_aware,whole_doc", "--json", str(out)]) == 0
    assert "kv_full_MB" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 and all(r["kv_MB"] <= r["kv_full_MB"] for r in rows)
    flash = next(r for r in rows if r["strategy"] == "flashcp")
    assert flash["kv_MB"] <= 0.5 * flash["kv_full_MB"]
    assert main(["simulate", "cp", "--window", "0"]) == 2
    assert "--window must be >= 1" in capsys.readouterr().err
