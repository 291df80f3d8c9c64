"""``flashpar simulate cp`` and ``simulate check`` of a ``bench cp`` report: pure Python, small packs."""

from __future__ import annotations

import json

import pytest

from flashpar.cli import main
from flashpar.cp import STRATEGIES, CostModel, plan
from flashpar.cp.lengths import resolve_lengths
from flashpar.sim import check_cp
from flashpar.sim.check import finish
from flashpar.sim.cp import parse_size, simulate

SMALL = ["--ranks", "4,8", "--tokens", "16K", "--lengths", "sotu,long-context", "--packs", "2"]


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "cp.json"
    assert main(["simulate", "cp", *SMALL, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_rows_for_every_strategy_and_the_json_layout(simulated):
    assert set(simulated) == {"setup", "rows"}
    rows = simulated["rows"]
    keys = {"strategy", "ranks", "tokens", "step_ms", "kv_bytes", "compute_imbalance", "plan_ms", "lengths",
            "token_imbalance", "vs_baseline"}
    assert all(keys <= set(r) for r in rows)
    cells = {(r["lengths"], r["ranks"], r["tokens"]) for r in rows}
    assert cells == {(s, n, "16K") for s in ("sotu", "long-context") for n in (4, 8)}
    for cell in cells:
        assert sorted(r["strategy"] for r in rows if (r["lengths"], r["ranks"], r["tokens"]) == cell) == \
            sorted(STRATEGIES)
    assert all(r["compute_imbalance"] >= 1 and r["token_imbalance"] >= 1 and r["plan_ms"] > 0 for r in rows)
    baseline = [r for r in rows if r["strategy"] == "megatron_dynamic"]
    assert all(r["vs_baseline"] == pytest.approx(1.0) for r in baseline)
    assert simulated["setup"]["hardware"] == "h100-ib" and simulated["setup"]["packs"] == 2


def test_kv_bytes_and_step_are_the_plans_own(simulated):
    # the first pack of sotu at 16K, N=8: the row's first pack step and (one pack) bytes from plan().stats()
    pack = resolve_lengths("sotu").packs(16384, 2)
    for s in ("per_doc", "megatron_dynamic", "flashcp"):
        row = next(r for r in simulated["rows"] if (r["lengths"], r["ranks"], r["strategy"]) == ("sotu", 8, s))
        stats = [plan(lens, 8, strategy=s).stats() for lens in pack]
        assert row["kv_bytes"] == pytest.approx(sum(st["total_kv_bytes"] for st in stats) / 2, rel=1e-12)
        assert row["step_ms_packs"] == pytest.approx([st["est_step_time"] * 1e3 for st in stats], rel=1e-12)


def test_flashcp_no_slower_than_megatron_dynamic_on_the_small_grid(simulated):
    versus = simulated["setup"]["flashcp_vs_megatron_dynamic"]
    assert len(versus) == 4 and all(v["no_slower"] for v in versus)
    by_pack = {}
    for r in simulated["rows"]:
        by_pack.setdefault((r["lengths"], r["ranks"]), {})[r["strategy"]] = r["step_ms_packs"]
    for steps in by_pack.values():
        assert all(f <= m * (1 + 1e-9) for f, m in zip(steps["flashcp"], steps["megatron_dynamic"], strict=True))


def test_where_megatron_dynamic_passes_the_token_cap_flashcp_is_compared_at_equal_memory():
    """python311_stdlib at 128K / N=32 (4K tokens per rank): megatron_dynamic puts up to 1.60x the mean tokens on
    a rank on both packs, past flashcp's cap (1.05x).  There flashcp is planned again with the cap that
    megatron_dynamic reached; that plan holds no more tokens on any rank and is estimated no slower.  At its
    own cap flashcp is estimated 2.4% slower on the first pack (the README's "simulate cp" notes)."""
    from flashpar.cp.flashcp import token_cap
    from flashpar.sim.cp import plan_figures, versus_row

    cost = CostModel()
    packs = resolve_lengths("python311_stdlib").packs(131072, 2, seed=0)
    figs = {s: [] for s in ("flashcp", "megatron_dynamic")}
    for lens in packs:
        for s in figs:
            figs[s].append(plan_figures(lens, 32, s, cost))
    assert all(m["token_peak"] > token_cap(lens, 32, 0.05) for lens, m in zip(packs, figs["megatron_dynamic"],
                                                                                strict=True))
    v = versus_row("python311_stdlib", 32, 131072, packs, figs["flashcp"], figs["megatron_dynamic"], cost)
    assert v["equal_memory_packs"] == 2 and v["no_slower"] and v["speedup_min"] >= 1
    assert len(v["speedup_at_cap"]) == 2 and all(f["token_peak"] <= token_cap(lens, 32, 0.05)
                                                 for lens, f in zip(packs, figs["flashcp"], strict=True))


def test_a_list_too_short_for_a_pack_is_skipped_with_a_note():
    grid, sources = [(8, 4 << 20)], {"sotu": resolve_lengths("sotu")}  # sotu: 2M tokens in all
    rows, versus, notes = simulate(grid, sources, ["flashcp"], CostModel(), packs=1)
    assert rows == [] and versus == [] and "no full pack of 4M" in notes[0]


def test_parse_size():
    assert [parse_size(x) for x in ("131072", "128K", "2m", "8M")] == [131072, 131072, 2 << 20, 8 << 20]
    with pytest.raises(ValueError, match="not a positive size"):
        parse_size("12G")


@pytest.mark.parametrize("argv, words", [
    (["--ranks", "64", "--tokens", "32"], "--ranks 64 > --tokens 32"),
    (["--lengths", "nosuchlist"], "unknown lengths 'nosuchlist'"),
    (["--strategies", "flashcp,ring"], "--strategies: unknown 'ring'"),
    (["--ranks", "0"], "--ranks: not a positive integer"),
    (["--tokens", "1X"], "--tokens: not a positive size"),
    (["--packs", "0"], "--packs must be >= 1"),
    (["--hardware", "tpu"], "unknown hardware preset 'tpu'"),
    (["--baseline", "ring"], "--baseline: unknown 'ring'"),
    (["--grid", "8:128K,32"], "--grid: '32' is not RANKS:TOKENS"),
    (["--grid", "1024:512"], "--ranks 1024 > --tokens 512"),
])
def test_bad_arguments_are_one_line(argv, words, capsys):
    assert main(["simulate", "cp", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashpar simulate cp: ") and words in err and err.count("\n") == 1, err


# ----------------------------------------------------------------------------------------------
# simulate check of a bench cp report


def synthetic_report(strategies=("contiguous", "headtail", "per_doc", "megatron_dynamic", "flashcp")) -> dict:
    """A bench cp report whose measurements are what the model predicts, built as the benchmark's rank 0 does
    (``flashpar.sim.bench_runs.cp_predict``, bytes from the plans' ``kv_send_bytes``): a perfect machine."""
    from flashpar.cost import shared_finish
    from flashpar.cp.cp_plan import rank_figures
    from flashpar.sim.bench_runs import cp_packs, cp_predict

    config = {"lengths": "sotu", "tokens": 2048, "scale": 16, "packs": 2, "cores": 2.0, "strategies": list(strategies)}
    shape = {"hidden": 128, "heads": 2, "kv_heads": 1, "head_dim": 64, "dtype_bytes": 4, "linear": False}
    fwd, bwd = (CostModel(**shape).with_hardware(attn_peak=peak, attn_half=half, link_bytes_per_s=3.6e7)
                for peak, half in ((5e-5, 60.0), (2e-5, 80.0)))
    packs, n = cp_packs(config), 4
    rows = {}
    for s in strategies:
        row = {"overlapped": 0.0, "bytes": 0, "pred_step": 0.0, "compute": 0.0, "comm": 0.0, "per_pack": []}
        imb = []
        for lens in packs:
            p = plan(lens, n, strategy=s, cost=fwd)
            step = cp_predict(p, fwd, bwd, config["cores"])["step"]
            row["overlapped"] += step
            row["pred_step"] += step
            row["bytes"] += sum(p.stats()["kv_send_bytes"])
            f, b = (shared_finish(rank_figures(p.segments, p.doc_lens, p.doc_starts, c, p.comm).compute, 2.0)
                    for c in (fwd, bwd))
            t = [x + y for x, y in zip(f, b, strict=True)]
            imb.append(max(t) / (sum(t) / n))
            row["compute"] += max(t)  # the compute-only run: the slowest rank's shared-core finish, fwd + bwd
            row["per_pack"].append({"rank_compute_fwd": f, "rank_compute_bwd": b})
            comm = [rank_figures(p.segments, p.doc_lens, p.doc_starts, c, p.comm).comm for c in (fwd, bwd)]
            row["comm"] += max(x + y for x, y in zip(*comm, strict=True))
        row["imbalance"] = row["pred_imbalance"] = sum(imb) / len(imb)
        rows[s] = row
    return {"world_size": n, "config": config, "packs": [len(x) for x in packs], "tokens": 2048,
            "fwd_cost": fwd.to_dict(), "bwd_cost": bwd.to_dict(), "rows": rows}


@pytest.fixture(scope="module")
def report():
    return synthetic_report()


def test_check_of_a_perfect_report_is_within(report):
    rows = [finish(r) for r in check_cp.check(report)]
    figures = {r["figure"] for r in rows}
    assert figures == {"x headtail", "x per_doc", "compute imbalance", "sent MB (exact)"}
    assert len(rows) == 2 * 4 + 5 + 5
    assert all(r["within"] == "yes" and r["why"] == "" for r in rows), [r for r in rows if r["within"] != "yes"]
    assert any(r["predicted"] > 1.2 for r in rows if r["figure"] == "x headtail")  # not all ratios are 1


def test_check_flags_a_perturbed_report(report):
    bad = json.loads(json.dumps(report))
    bad["rows"]["flashcp"]["overlapped"] *= 1.3  # flashcp measured 30% slower than predicted
    bad["rows"]["headtail"]["imbalance"] *= 1.2
    bad["rows"]["per_doc"]["bytes"] += 4  # one float short or over: a count, never within a tolerance
    rows = [finish(r) for r in check_cp.check(bad)]
    missed = {(r["row"], r["figure"]) for r in rows if r["within"] == "no"}
    assert missed == {("flashcp", "x headtail"), ("flashcp", "x per_doc"), ("headtail", "compute imbalance"),
                      ("per_doc", "sent MB (exact)")}
    assert all(r["why"] == "" for r in rows if r["row"] == "flashcp")  # its parts were measured as predicted
    bad["rows"]["flashcp"]["compute"] *= 1.3  # now the compute-only part shows where the step's miss comes from
    why = [r["why"] for r in check_cp.check(bad) if r["row"] == "flashcp" and r["figure"] == "x headtail"][0]
    assert "compute-only measured/predicted 1.30 vs 1.00" in why
    imb = [r for r in check_cp.check(bad) if r["row"] == "headtail" and r["figure"] == "compute imbalance"][0]
    assert imb["why"] == ""  # the imbalance alone was perturbed: the per-rank times do not show why
    for pack in bad["rows"]["headtail"]["per_pack"]:  # the busiest rank measured 30% slower than predicted
        busy = max(range(4), key=lambda r, pack=pack: pack["rank_compute_fwd"][r] + pack["rank_compute_bwd"][r])
        pack["rank_compute_fwd"][busy] *= 1.3
        pack["rank_compute_bwd"][busy] *= 1.3
    imb = [r for r in check_cp.check(bad) if r["row"] == "headtail" and r["figure"] == "compute imbalance"][0]
    assert "1.30 on the busiest rank" in imb["why"] and "1.00 on the others" in imb["why"]


def test_check_falls_back_to_stored_predictions_and_says_so(report):
    old = json.loads(json.dumps(report))
    del old["config"]["lengths"]
    rows = check_cp.check(old)
    assert all("stored predictions used" in r["why"] for r in rows)
    assert not any(r["figure"] == "sent MB (exact)" for r in rows)  # bytes cannot be predicted without the plans


def test_simulate_check_command_on_a_bench_cp_file(report, tmp_path, capsys):
    path = tmp_path / "bench-cp.json"
    path.write_text(json.dumps(report))
    assert main(["simulate", "check", str(path), "--strict"]) == 0
    out = capsys.readouterr().out
    assert "bench cp:" in out and "18 of 18 ratios within 15%" in out

